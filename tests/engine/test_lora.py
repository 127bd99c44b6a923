"""LoRA adapters (the Modelfile's ADAPTER) applied by the llama.cpp backend, with a tiny base model and adapter."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import Adapter, LoadOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lora import tiny_llama_shapes, write_tiny_lora

PROMPTS = ["hello world", "ab", "The cat sat"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("lora")
    base = write_tiny_llama(folder / "base.gguf")
    return base, write_tiny_lora(folder / "lora.gguf", base)


def options(*adapters: Path) -> LoadOptions:
    return LoadOptions(
        num_ctx=128, num_parallel=2, num_batch=64, num_threads=2, adapters=tuple(str(a) for a in adapters)
    )


async def greedy(path: Path, *adapters: Path) -> tuple[list[str], list[float]]:
    """Greedy continuations of PROMPTS, and the embedding of the first, from a fresh engine."""
    engine = BatchingEngine(LlamaCppBackend(path, options(*adapters)))
    try:
        texts = []
        for prompt in PROMPTS:
            stream = engine.submit(
                engine.tokenize(prompt), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), special=True
            )
            texts.append("".join([chunk.text async for chunk in stream]))
        (vector,) = await engine.embed([PROMPTS[0]])
        return texts, vector
    finally:
        engine.close()


async def test_an_adapter_changes_the_output_and_only_where_it_is_loaded(files: tuple[Path, Path]) -> None:
    base, lora = files
    plain, plain_vector = await greedy(base)
    adapted, adapted_vector = await greedy(base, lora)
    assert all(a != b for a, b in zip(plain, adapted, strict=True))
    assert max(abs(a - b) for a, b in zip(plain_vector, adapted_vector, strict=True)) > 0.1  # embeddings too
    assert (await greedy(base, lora))[0] == adapted  # deterministic
    assert await greedy(base) == (plain, plain_vector)  # the adapter belonged to the other load only


async def test_the_same_adapter_twice_is_twice_the_change(files: tuple[Path, Path], tmp_path: Path) -> None:
    base, lora = files
    doubled = write_tiny_lora(tmp_path / "double.gguf", base, alpha=8.0)  # alpha / rank = 2
    twice, twice_vector = await greedy(base, lora, lora)
    once_doubled, doubled_vector = await greedy(base, doubled)
    assert twice == once_doubled
    assert twice_vector == pytest.approx(doubled_vector, abs=1e-4)
    assert twice != (await greedy(base, lora))[0]


def test_the_adapter_paths_are_load_options() -> None:
    assert options() != options(Path("a.gguf"))
    assert options(Path("a.gguf")) == options(Path("a.gguf"))


@pytest.mark.parametrize("kind", ["missing", "not-an-adapter", "other-arch", "wrong-shapes", "garbage"])
def test_a_bad_adapter_is_an_engine_failure_naming_the_file(
    files: tuple[Path, Path], tmp_path: Path, kind: str
) -> None:
    base, _ = files
    bad = tmp_path / f"{kind}.gguf"
    if kind == "not-an-adapter":
        bad.write_bytes(base.read_bytes())
    elif kind == "other-arch":
        write_tiny_lora(bad, base, architecture="qwen2")
    elif kind == "wrong-shapes":
        write_tiny_lora(bad, tiny_llama_shapes(n_vocab=300))
    elif kind == "garbage":
        bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(EngineFailure) as info:
        LlamaCppBackend(base, options(files[1], bad))
    assert bad.name in info.value.message
    LlamaCppBackend(base, options(files[1])).close()  # what the failed load created was freed


async def per_request(engine: BatchingEngine, *adapters: Adapter) -> list[str]:
    """Greedy continuations of PROMPTS, one after another, with the adapters on each request."""
    texts = []
    for prompt in PROMPTS:
        sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapters=adapters)
        texts.append("".join([chunk.text async for chunk in engine.submit(engine.tokenize(prompt), sampling,
                                                                         special=True)]))
    return texts


async def test_an_adapter_per_request_is_the_adapter_loaded_with_the_model(files: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    base, lora = files
    other = write_tiny_lora(tmp_path / "other.gguf", base, seed=7)
    engine = BatchingEngine(LlamaCppBackend(base, options()))
    try:
        assert await per_request(engine, Adapter(str(lora))) == (await greedy(base, lora))[0]
        assert await per_request(engine) == (await greedy(base))[0]  # the next request without: the base
        assert await per_request(engine, Adapter(str(other))) == (await greedy(base, other))[0]
        assert await per_request(engine, Adapter(str(lora), 0.0)) == (await greedy(base))[0]  # scale 0: off
        assert await per_request(engine, Adapter(str(lora)), Adapter(str(lora))) == \
            (await greedy(base, lora, lora))[0]
    finally:
        engine.close()


async def test_adapters_beyond_the_limit_free_the_least_recently_used(files: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    base, lora = files
    others = [write_tiny_lora(tmp_path / f"{seed}.gguf", base, seed=seed) for seed in (2, 3)]
    backend = LlamaCppBackend(base, options(), adapter_limits=(2, 0))
    engine = BatchingEngine(backend)
    try:
        first = await per_request(engine, Adapter(str(lora)))
        for path in others:
            await per_request(engine, Adapter(str(path)))
        assert backend._loaded.adapters.loaded == [str(others[0]), str(others[1])]
        assert await per_request(engine, Adapter(str(lora))) == first  # loaded again on its next use
    finally:
        engine.close()


def test_a_bad_adapter_on_a_request_is_a_400_naming_it(files: tuple[Path, Path], tmp_path: Path) -> None:
    base, _ = files
    engine = BatchingEngine(LlamaCppBackend(base, options(), adapter_limits=(2, 2)))
    try:
        with pytest.raises(InvalidRequest, match=r"other\.gguf is for a qwen2 model"):
            engine.submit(engine.tokenize("hi"), SamplingParams(
                adapters=(Adapter(str(write_tiny_lora(tmp_path / "other.gguf", base, architecture="qwen2"))),)))
        with pytest.raises(InvalidRequest, match=r"rank 4, over this server's limit of 2"):
            engine.submit(engine.tokenize("hi"), SamplingParams(adapters=(Adapter(str(files[1])),)))
    finally:
        engine.close()


async def test_embeddings_follow_the_adapters_asked(files: tuple[Path, Path]) -> None:
    base, lora = files
    engine = BatchingEngine(LlamaCppBackend(base, options()))
    try:
        tokens = [engine.embedding_tokens(PROMPTS[0])]
        adapted = (await engine.embed_tokens(tokens, adapters=(Adapter(str(lora)),)))[0]
        plain = (await engine.embed_tokens(tokens))[0]
        assert plain == pytest.approx((await greedy(base))[1], abs=1e-4)
        assert adapted == pytest.approx((await greedy(base, lora))[1], abs=1e-4)
    finally:
        engine.close()
