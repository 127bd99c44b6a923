"""The llama.cpp backend with the real embedded model, driven through the engine loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as lc
import pytest

from lmserve.engine.llamacpp import cpu_load
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.cpu_load import CpuTimes, read_cpu_times
from lmserve.engine.llamacpp.loading import load_mode
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.errors import ContextOverflow, InvalidRequest
from lmserve.types import Chunk, LoadOptions, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about cats.",
    "Count from 1 to 10.",
    "Explain gravity in one sentence.",
    "Name five fruits.",
    "What is 12 times 7?",
    "Tell me a joke about computers.",
    "Describe the ocean to a child.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[BatchingEngine]:
    eng = BatchingEngine(LlamaCppBackend(model_path, LoadOptions(num_ctx=512, num_parallel=8, num_batch=256)))
    yield eng
    eng.close()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def generate(engine: BatchingEngine, prompt: str, **sampling: object) -> tuple[list[Chunk], str]:
    stream = engine.submit(engine.tokenize(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]
    chunks = [c async for c in stream]
    return chunks, "".join(c.text for c in chunks)


async def test_model_info_comes_from_the_gguf(engine: BatchingEngine) -> None:
    info = engine.info
    assert info.architecture == "llama"
    assert info.num_ctx == 512
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert info.eos_token == "<|im_end|>"


async def test_greedy_answer_is_sensible_and_stops_at_end_of_turn(engine: BatchingEngine) -> None:
    chunks, text = await generate(engine, chat(PROMPTS[0]), temperature=0, max_tokens=40)
    assert "Paris" in text
    assert chunks[-1].finish_reason == "stop"
    assert "<|im_end|>" not in text


async def test_temperature_zero_is_the_same_alone_and_beside_seven_others(engine: BatchingEngine) -> None:
    alone = [(await generate(engine, chat(p), temperature=0, max_tokens=24))[1] for p in PROMPTS]
    together = await asyncio.gather(*(generate(engine, chat(p), temperature=0, max_tokens=24) for p in PROMPTS))
    assert [text for _, text in together] == alone
    assert len(set(alone)) == len(alone)


async def test_same_seed_same_output_different_seed_different_output(engine: BatchingEngine) -> None:
    params = {"temperature": 1.2, "top_p": 0.95, "max_tokens": 24, "ignore_eos": True}
    prompt = chat("Invent a name for a dragon.")
    first = (await generate(engine, prompt, seed=1234, **params))[1]
    runs = await asyncio.gather(
        generate(engine, prompt, seed=1234, **params),
        generate(engine, chat(PROMPTS[1]), seed=5, **params),
        *(generate(engine, prompt, seed=s, **params) for s in (1, 2, 3)),
    )
    assert runs[0][1] == first
    assert any(text != first for _, text in runs[2:])


async def test_stop_string_ends_generation_without_leaking(engine: BatchingEngine) -> None:
    _, full = await generate(engine, chat(PROMPTS[0]), temperature=0, max_tokens=40)
    assert "Paris" in full
    chunks, text = await generate(engine, chat(PROMPTS[0]), temperature=0, max_tokens=40, stop=["Paris"])
    assert text == full[: full.index("Paris")]
    assert chunks[-1].finish_reason == "stop"


async def test_max_tokens_and_ignore_eos_give_exactly_that_many_tokens(engine: BatchingEngine) -> None:
    chunks, _ = await generate(engine, chat("Hi"), temperature=0, max_tokens=30, ignore_eos=True)
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 30


async def test_characters_split_across_tokens_stream_whole(engine: BatchingEngine) -> None:
    # SmolLM2 continues this with full-width exclamation mark U+FF01, whose UTF-8 bytes it spells with two tokens.
    stream = engine.submit(engine.tokenize("你好你好你好你好你好你好"), SamplingParams(temperature=0, max_tokens=12))
    texts = [c.text async for c in stream]
    pieces = [engine.backend.token_bytes(t, special=False) for t in stream.seq.output]
    assert any(_is_partial_utf8(piece) for piece in pieces)
    assert "".join(texts) == b"".join(pieces).decode("utf-8")
    assert all("\ufffd" not in text for text in texts)


def _is_partial_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


async def test_prompt_longer_than_the_context_is_refused_with_both_numbers(engine: BatchingEngine) -> None:
    tokens = engine.tokenize(chat("word " * 600))
    with pytest.raises(ContextOverflow) as info:
        engine.submit(tokens, SamplingParams())
    assert str(len(tokens)) in info.value.message and "512" in info.value.message


async def test_abort_frees_the_slot_and_keeps_only_decoded_state(engine: BatchingEngine) -> None:
    stream = engine.submit(engine.tokenize(chat("Tell a long story.")), SamplingParams(max_tokens=400, ignore_eos=True))
    async for _ in stream:
        break
    slot = stream.seq.slot
    stream.abort()
    for _ in range(3000):  # one decode step is enough; the bound only guards a loaded machine
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0
    memory = lc.llama_get_memory(engine.backend._ctx)  # type: ignore[attr-defined]
    held = engine.scheduler.slot_tokens[slot]
    assert lc.llama_memory_seq_pos_max(memory, slot) == len(held) - 1
    assert held == (stream.seq.prompt + stream.seq.output)[: len(held)]


async def test_a_repeated_prompt_reuses_the_cached_prefix_and_gives_the_same_text(engine: BatchingEngine) -> None:
    prompt = chat("Name the planets of the solar system.")
    _, text = await generate(engine, prompt, temperature=0, max_tokens=24)
    again, text_again = await generate(engine, prompt, temperature=0, max_tokens=24)
    num_prompt = len(engine.tokenize(prompt))
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == num_prompt - 1
    assert text_again == text
    follow_up = prompt + text + "<|im_end|>\n" + chat("And their moons?")
    chunks, _ = await generate(engine, follow_up, temperature=0, max_tokens=4)
    assert chunks[-1].usage is not None and chunks[-1].usage.cached_tokens >= num_prompt


async def test_a_context_beyond_the_trained_one_is_clamped_to_it(model_path: Path) -> None:
    backend = LlamaCppBackend(model_path, LoadOptions(num_ctx=10**6, num_parallel=1, num_batch=64))
    try:
        assert backend.info.num_ctx == 8192  # SmolLM2's trained context
    finally:
        backend.close()


async def test_a_huge_repeat_window_is_bounded_by_the_context(engine: BatchingEngine) -> None:
    _, text = await generate(engine, chat("Hi"), temperature=0, max_tokens=4, repeat_penalty=1.1,
                             repeat_last_n=2**30)
    assert text


async def test_typical_p_of_one_changes_nothing_and_other_values_are_taken(engine: BatchingEngine) -> None:
    prompt = chat(PROMPTS[4])
    _, plain = await generate(engine, prompt, temperature=0.7, seed=11, max_tokens=16)
    _, typical_one = await generate(engine, prompt, temperature=0.7, seed=11, max_tokens=16, typical_p=1.0)
    assert typical_one == plain
    for sampling in ({"typical_p": 0.5}, {"mirostat": 1}, {"mirostat": 2, "mirostat_tau": 3.0}):
        chunks, text = await generate(engine, prompt, temperature=0.7, seed=11, max_tokens=8, **sampling)
        assert text and chunks[-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("given", "mode"), [
    ({}, lc.LLAMA_LOAD_MODE_AUTO), ({"use_mmap": False}, lc.LLAMA_LOAD_MODE_NONE),
    ({"use_mmap": True}, lc.LLAMA_LOAD_MODE_MMAP), ({"use_mlock": True}, lc.LLAMA_LOAD_MODE_MMAP_MLOCK),
    ({"use_mmap": False, "use_mlock": True, "main_gpu": 0}, lc.LLAMA_LOAD_MODE_MLOCK),
])  # fmt: skip
async def test_weights_load_with_each_mmap_mode(model_path: Path, given: dict[str, Any], mode: int) -> None:
    options = LoadOptions(num_ctx=256, num_parallel=1, num_batch=64, **given)
    assert load_mode(options) == mode
    backend = LlamaCppBackend(model_path, options)
    try:
        assert backend.tokenize("Hello", add_special=False, parse_special=False)
    finally:
        backend.close()


async def kv_state_bytes_and_answer(model_path: Path, **kv: str) -> tuple[int, str]:
    """The size of one slot's saved state (its KV cells) after a greedy answer, and the answer, with `kv` options."""
    engine = BatchingEngine(LlamaCppBackend(model_path, LoadOptions(num_ctx=512, num_parallel=1, num_batch=64),
                                            LlamaCppLaunch(**kv)))
    try:
        _, text = await generate(engine, chat(PROMPTS[0]), temperature=0, max_tokens=16)
        backend = engine.backend
        assert isinstance(backend, LlamaCppBackend)
        return len(backend.save_state(0)), text
    finally:
        engine.close()


async def test_a_quantized_kv_cache_takes_less_memory_and_still_answers(model_path: Path) -> None:
    f16, plain = await kv_state_bytes_and_answer(model_path)
    q8, eight = await kv_state_bytes_and_answer(model_path, cache_type_k="q8_0", cache_type_v="q8_0")
    q4, four = await kv_state_bytes_and_answer(model_path, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn="on")
    assert q8 <= 0.55 * f16 and q4 <= 0.3 * f16  # q8_0: 34 bytes per 32 values, q4_0: 18, f16: 64
    assert "Paris" in plain and "Paris" in eight and four


@pytest.mark.parametrize(("kv", "message"), [
    ({"cache_type_k": "q3_k"}, "--cache-type-k q3_k is not a KV cache type"),
    ({"flash_attn": "maybe"}, "--flash-attn maybe: choose on, off or auto"),
    ({"cache_type_v": "q8_0", "flash_attn": "off"}, "--cache-type-v q8_0 needs flash attention"),
])  # fmt: skip
async def test_unusable_kv_options_are_refused_naming_them(model_path: Path, kv: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        LlamaCppBackend(model_path, LoadOptions(num_ctx=256, num_parallel=1, num_batch=64), LlamaCppLaunch(**kv))


class BusyMachine:
    """/proc/stat of a machine whose other programs keep `outside` cores busy (this process's time is real)."""

    def __init__(self, outside: float) -> None:
        self.outside = outside
        self.started = time.monotonic()

    def read(self) -> CpuTimes:
        real = read_cpu_times()
        own = real.own if real is not None else 0.0
        now = time.monotonic()
        return CpuTimes(busy=own + self.outside * (now - self.started), own=own, wall=now)


@pytest.mark.parametrize(("policy", "outside", "threads"), [
    ("adaptive", 1.5, 1), ("adaptive", 0.0, 2), ("fixed", 1.5, 2),
])  # fmt: skip
async def test_steps_compute_with_the_cores_the_machine_leaves_free(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    policy: str, outside: float, threads: int) -> None:
    monkeypatch.setattr(cpu_load, "read_cpu_times", BusyMachine(outside).read)
    options = LoadOptions(num_ctx=512, num_parallel=1, num_batch=64, num_threads=2)
    engine = BatchingEngine(LlamaCppBackend(model_path, options, LlamaCppLaunch(thread_policy=policy)))
    try:
        await asyncio.sleep(0.6)  # the governor reads the machine at most every 0.25 s
        _, text = await generate(engine, chat(PROMPTS[0]), temperature=0, max_tokens=24, ignore_eos=True)
        backend = engine.backend
        assert isinstance(backend, LlamaCppBackend)
        assert backend.step_threads == threads and "Paris" in text
    finally:
        engine.close()
