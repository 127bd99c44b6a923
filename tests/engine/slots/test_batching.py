"""The engine loop over a fake backend: streaming, stops, limits, aborts, concurrency."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import AsyncIterator

import pytest

from lmserve.engine.protocol import PromptImage
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import ContextOverflow, EngineStopped, InvalidRequest, Overloaded
from lmserve.types import Adapter, Bitmap, Chunk, SamplingParams


@pytest.fixture
async def engine() -> AsyncIterator[BatchingEngine]:
    eng = BatchingEngine(FakeBackend(num_ctx=64, num_parallel=2), max_batch_tokens=16, max_prefill_tokens=8)
    yield eng
    eng.close()


async def collect(engine: BatchingEngine, prompt: str, **sampling: object) -> tuple[str, Chunk]:
    chunks = [c async for c in engine.submit(engine.tokenize(prompt), SamplingParams(**sampling))]  # type: ignore[arg-type]
    return "".join(c.text for c in chunks), chunks[-1]


async def test_generates_until_max_tokens(engine: BatchingEngine) -> None:
    text, last = await collect(engine, "hello", max_tokens=12)
    assert text == FakeBackend.expected(5, 12)
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 12)


async def test_stop_string_ends_and_is_not_emitted(engine: BatchingEngine) -> None:
    full = FakeBackend.expected(5, 30)
    stop = full[10:14]
    text, last = await collect(engine, "hello", max_tokens=30, stop=[stop])
    assert text == full[: full.index(stop)]
    assert last.finish_reason == "stop"


async def test_end_of_generation_token_stops() -> None:
    eng = BatchingEngine(FakeBackend(num_ctx=64, num_parallel=1, eog_after=3))
    try:
        text, last = await collect(eng, "abc", max_tokens=30)
        assert text == FakeBackend.expected(3, 3)
        assert last.finish_reason == "stop"
    finally:
        eng.close()


@pytest.mark.parametrize("max_tokens", [None, 32000])  # 32000: what Claude Code asks for, whatever the context
async def test_context_limit_caps_generation(engine: BatchingEngine, max_tokens: int | None) -> None:
    """A reply may take what the prompt leaves of the context, however many tokens were asked for: the request is
    not refused, and the reply ends with finish reason "length" when the context is full."""
    _text, last = await collect(engine, "x" * 60, max_tokens=max_tokens)
    assert last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 4


async def test_prompt_longer_than_context_is_refused(engine: BatchingEngine) -> None:
    with pytest.raises(ContextOverflow) as info:
        engine.submit(engine.tokenize("x" * 64), SamplingParams())
    assert "64" in info.value.message


async def test_more_requests_than_slots_all_complete(engine: BatchingEngine) -> None:
    prompts = [f"prompt number {i}" for i in range(7)]
    results = await asyncio.gather(*(collect(engine, p, max_tokens=9) for p in prompts))
    for prompt, (text, last) in zip(prompts, results, strict=True):
        assert text == FakeBackend.expected(len(prompt), 9)
        assert last.finish_reason == "length"
    assert engine.num_running == 0


async def test_abort_frees_the_slot() -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=4096, num_parallel=2, step_delay=0.01))
    stream = engine.submit(engine.tokenize("hello"), SamplingParams(max_tokens=1000))
    async for _ in stream:
        break
    assert engine.num_running == 1
    stream.abort()
    for _ in range(100):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0
    text, _ = await collect(engine, "again", max_tokens=3)
    assert text == FakeBackend.expected(5, 3)
    engine.close()


@pytest.mark.parametrize(
    ("prompt", "bias"),
    [([1, 2, 257], {}), ([-1, 2], {}), ([1, 2], {300: 1.0}), ([1, 2], {-5: 1.0})],
)
async def test_token_ids_outside_the_vocabulary_are_refused(
    engine: BatchingEngine, prompt: list[int], bias: dict[int, float]
) -> None:
    with pytest.raises(InvalidRequest):
        engine.submit(prompt, SamplingParams(logit_bias=bias))
    assert engine.num_waiting == 0


async def test_a_full_queue_refuses_with_overloaded_and_the_rest_complete() -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=256, num_parallel=1, step_delay=0.01), max_queue=2)
    try:
        streams, refused = [], 0
        for i in range(6):
            try:
                streams.append(engine.submit(engine.tokenize(f"request {i}"), SamplingParams(max_tokens=3)))
            except Overloaded:
                refused += 1
        assert refused >= 3  # one may be running, at most two wait
        for stream in streams:
            chunks = [c async for c in stream]
            assert chunks[-1].finish_reason == "length"
    finally:
        engine.close()


async def test_a_burst_as_large_as_the_free_slots_is_admitted_whatever_the_queue() -> None:
    """Eight requests at once on eight free slots and a queue of two: none waits, so none is refused (they were
    counted as waiting before the engine thread admitted them); the ninth and tenth wait, the eleventh is refused."""
    engine = BatchingEngine(FakeBackend(num_ctx=256, num_parallel=8, step_delay=0.05), max_queue=2)
    try:
        streams = [engine.submit(engine.tokenize(f"request {i}"), SamplingParams(max_tokens=40)) for i in range(10)]
        with pytest.raises(Overloaded):
            engine.submit(engine.tokenize("one too many"), SamplingParams(max_tokens=3))
        for stream in streams:
            chunks = [c async for c in stream]
            assert chunks[-1].finish_reason == "length"
    finally:
        engine.close()


def bitmap(width: int, height: int, shade: int = 0) -> Bitmap:
    return Bitmap(width, height, bytes([shade]) * (width * height * 3))


async def test_image_requests_decode_beside_text_requests_and_count_image_positions() -> None:
    backend = FakeBackend(num_ctx=256, num_parallel=4, vision=True)
    eng = BatchingEngine(backend, max_batch_tokens=32, max_prefill_tokens=16)
    try:
        tokens, images = eng.tokenize_media("look <image> here", [bitmap(32, 16)])  # 512 px: 2 positions
        assert [(i.start, i.length) for i in images] == [(5, 2)]
        assert len(tokens) == len("look  here") + 2

        async def run(prompt: list[int], places: list[PromptImage] | None) -> Chunk:
            chunks = [c async for c in eng.submit(prompt, SamplingParams(max_tokens=6), images=places)]
            return chunks[-1]

        text_only = eng.tokenize("plain text")
        finals = await asyncio.gather(run(tokens, images), run(text_only, None), run(tokens, images))
        assert [f.usage.prompt_tokens for f in finals if f.usage] == [len(tokens), len(text_only), len(tokens)]
        image_steps = [e for step in backend.steps for e in step if e.image is not None]
        assert len(image_steps) == 2 and all(e.tokens == [] and e.num_positions == 2 for e in image_steps)
        # Text and image entries of different sequences share steps: nothing waits for an image to finish alone.
        assert any(any(e.image is not None for e in step) and any(e.image is None for e in step)
                   for step in backend.steps)
    finally:
        eng.close()


async def test_image_prompts_are_checked_at_submit() -> None:
    eng = BatchingEngine(FakeBackend(num_ctx=64, num_parallel=1, vision=True))
    try:
        tokens, images = eng.tokenize_media("a<image>", [bitmap(16, 16)])
        with pytest.raises(InvalidRequest, match="followed by text"):  # no text after the image to sample from
            eng.submit(tokens, SamplingParams(), images=images)
        tokens, images = eng.tokenize_media("a<image>b", [bitmap(16, 16)])
        with pytest.raises(InvalidRequest, match="token ids"):  # placeholders outside an image are no tokens
            eng.submit(tokens, SamplingParams())
        with pytest.raises(InvalidRequest, match="markers"):
            eng.tokenize_media("a<image>b<image>", [bitmap(16, 16)])
    finally:
        eng.close()


async def test_a_model_without_vision_refuses_images(engine: BatchingEngine) -> None:
    with pytest.raises(InvalidRequest, match="no projector; images and audio are not supported"):
        engine.tokenize_media("x", [bitmap(4, 4)])


async def test_requests_sharing_a_long_prompt_copy_it_from_the_first() -> None:
    backend = FakeBackend(num_ctx=1024, num_parallel=4)
    eng = BatchingEngine(backend, max_batch_tokens=64, max_prefill_tokens=32)
    try:
        shared = "a system prompt long enough to be worth sharing " * 3
        prompts = [eng.tokenize(shared + f"question {i}") for i in range(4)]
        num_shared = len(eng.tokenize(shared + "question "))
        finals = await asyncio.gather(*(
            _last(eng.submit(p, SamplingParams(max_tokens=3))) for p in prompts))
        # The first computes the shared part; the other three wait for it and copy it into their slots.
        assert sorted(f.usage.cached_tokens for f in finals if f.usage) == [0] + [num_shared] * 3
        assert sorted(length for _, _, length in backend.copies) == [num_shared] * 3
        fed = sum(len(e.tokens) for step in backend.steps for e in step)
        # Every prompt token once, except the copied ones; then 2 decoded tokens per request (the 3rd is only sampled).
        assert fed == sum(len(p) for p in prompts) - 3 * num_shared + 4 * 2
    finally:
        eng.close()


async def _last(stream: AsyncIterator[Chunk]) -> Chunk:
    chunks = [c async for c in stream]
    return chunks[-1]


SENTENCE = "The quick brown fox jumps over the lazy dog. "
"""The fake's own text: a prompt of it makes every later sentence a repeat, so prompt lookup drafts well."""


async def test_drafted_tokens_the_model_agrees_with_are_taken_in_one_step() -> None:
    backend = FakeBackend(num_ctx=512, num_parallel=1)
    eng = BatchingEngine(backend, draft_max=8)
    try:
        text, last = await collect(eng, SENTENCE * 2, max_tokens=120, temperature=0)
        assert text == FakeBackend.expected(len(SENTENCE) * 2, 120)  # the output of plain decoding
        usage = last.usage
        assert usage is not None and usage.completion_tokens == 120
        assert usage.draft_accepted_tokens > 80 and usage.draft_tokens >= usage.draft_accepted_tokens
        decode_steps = [step for step in backend.steps if any(entry.wants_sample for entry in step)]
        assert len(decode_steps) < 40  # 120 tokens in far fewer steps
        assert max(entry.draft for step in backend.steps for entry in step) == 8
    finally:
        eng.close()


@pytest.mark.parametrize(("engine_most", "asked", "drafts"), [(0, None, False), (0, 8, True), (8, 0, False),
                                                               (8, None, True)])
async def test_a_request_turns_drafting_on_or_off_over_the_engines_default(engine_most: int, asked: int | None,
                                                                           drafts: bool) -> None:
    eng = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=1), draft_max=engine_most)
    try:
        text, last = await collect(eng, SENTENCE * 2, max_tokens=60, draft_max=asked)
        assert text == FakeBackend.expected(len(SENTENCE) * 2, 60)
        assert last.usage is not None and (last.usage.draft_tokens > 0) == drafts
    finally:
        eng.close()


@pytest.mark.parametrize("limits", [{"max_tokens": 37}, {"stop": ["lazy"]}, {"max_tokens": 200, "stop": ["fox j"]}])
async def test_limits_and_stops_inside_an_accepted_draft_end_the_reply_where_plain_decoding_does(
        limits: dict[str, object]) -> None:
    plain = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=1))
    drafted = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=1), draft_max=16)
    try:
        prompt = SENTENCE * 3 + "The quick"
        expected = await collect(plain, prompt, **limits)
        got = await collect(drafted, prompt, **limits)
        assert got[0] == expected[0] and got[1].finish_reason == expected[1].finish_reason
        assert got[1].usage is not None and expected[1].usage is not None
        assert got[1].usage.completion_tokens == expected[1].usage.completion_tokens
    finally:
        plain.close()
        drafted.close()


async def test_concurrent_drafting_sequences_each_get_their_own_output() -> None:
    eng = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2), draft_max=8, max_batch_tokens=12)
    try:
        prompts = [SENTENCE * 2 + "x" * i for i in range(4)]
        results = await asyncio.gather(*(collect(eng, p, max_tokens=50, seed=i) for i, p in enumerate(prompts)))
        for i, (prompt, (text, _)) in enumerate(zip(prompts, results, strict=True)):
            assert text == FakeBackend.expected(len(prompt), 50, seed=i)
    finally:
        eng.close()


async def test_a_draft_model_drafts_for_every_decoding_sequence_in_one_call() -> None:
    backend = FakeBackend(num_ctx=512, num_parallel=2, draft_model=True)
    eng = BatchingEngine(backend, draft_max=6)
    try:
        prompts = ["no repeats here", "zebra"]  # nothing to look up: every draft comes from the draft model
        replies = await asyncio.gather(*(collect(eng, prompt, max_tokens=40) for prompt in prompts))
        for prompt, (text, last) in zip(prompts, replies, strict=True):
            assert text == FakeBackend.expected(len(prompt), 40)  # the output of plain decoding
            assert last.usage is not None and last.usage.draft_accepted_tokens > 10
        assert any(len(requests) == 2 for requests in backend.draft_requests)  # both sequences in one call
        for requests in backend.draft_requests:
            for tokens, most in requests.values():  # the prompt, the output so far (its last token still pending)
                prompt = next(p.encode() for p in prompts if bytes(tokens).startswith(p.encode()))
                made = len(tokens) - len(prompt)
                assert bytes(tokens[len(prompt):]).decode() == FakeBackend.expected(len(prompt), made)
                assert 0 < most <= min(6, 40 - made)
        _, off = await collect(eng, "zebra", max_tokens=20, draft_max=0)
        assert off.usage is not None and off.usage.draft_tokens == 0
    finally:
        eng.close()


async def test_a_hybrid_model_drafts_as_any_other() -> None:
    backend = FakeBackend(num_ctx=512, num_parallel=1)
    backend.info = dataclasses.replace(backend.info, can_cut_memory=False)  # the backend rewinds its memory itself
    hybrid = BatchingEngine(backend, draft_max=8)
    try:
        text, last = await collect(hybrid, SENTENCE * 2, max_tokens=30)
        assert text == FakeBackend.expected(len(SENTENCE) * 2, 30)
        assert last.usage is not None and last.usage.draft_accepted_tokens > 0
    finally:
        hybrid.close()


async def test_an_error_that_breaks_the_engine_thread_fails_every_request_and_the_engine() -> None:
    """An error outside what a step handles (here the fake's `fault`, raised when a slot is released) ends the
    engine thread: every request in flight ends with an error saying so, the engine reports its failure, and new
    requests and embeddings are refused with EngineStopped (503) instead of waiting forever."""
    backend = FakeBackend(num_ctx=4096, num_parallel=2, step_delay=0.005)
    engine = BatchingEngine(backend)
    try:
        long = engine.submit(engine.tokenize("a long one"), SamplingParams(max_tokens=3000))
        async for _ in long:
            break
        assert engine.failure is None
        backend.fault = "the slot's memory is gone"
        _, short_last = await collect(engine, "short", max_tokens=2)
        long_last = [chunk async for chunk in long][-1]
        cause = "its engine thread failed: RuntimeError: the slot's memory is gone"
        for last in (short_last, long_last):
            assert (last.finish_reason, last.error) == ("error", f"the engine stopped: {cause}")
        assert engine.failure == cause
        with pytest.raises(EngineStopped, match="the slot's memory is gone"):
            engine.submit(engine.tokenize("again"), SamplingParams(max_tokens=2))
        with pytest.raises(EngineStopped, match="the slot's memory is gone"):
            await engine.embed(["again"])
    finally:
        engine.close()


class StuckBackend(FakeBackend):
    """A fake whose steps, once `hold` is set, wait for `release`: one step of a very busy machine."""

    def __init__(self) -> None:
        super().__init__(num_ctx=4096, num_parallel=2)
        self.hold = False
        self.stuck = threading.Event()
        self.release = threading.Event()

    def step(self, entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        if self.hold:
            self.stuck.set()
            self.release.wait(60)
        return super().step(entries, adapters)


async def test_fail_all_ends_every_stream_at_once_even_while_a_step_is_still_running() -> None:
    """Graceful shutdown's deadline: the streams end with the error now, not when the engine's step is done."""
    backend = StuckBackend()
    engine = BatchingEngine(backend)
    try:
        streams = [engine.submit(engine.tokenize(prompt), SamplingParams(max_tokens=3000))
                   for prompt in ("one story", "another story")]
        for stream in streams:
            async for _ in stream:
                break
        backend.hold = True
        assert await asyncio.to_thread(backend.stuck.wait, 30)
        engine.fail_all("the server is shutting down")
        for stream in streams:
            last = await asyncio.wait_for(_last(stream), timeout=30)
            assert (last.finish_reason, last.error) == ("error", "the server is shutting down")
    finally:
        backend.release.set()
        engine.close()


async def test_kv_cache_usage_is_the_cells_the_slots_hold_over_all_cells(engine: BatchingEngine) -> None:
    """The KV cache is num_ctx cells per slot (block size 1); a finished request's prompt and reply stay in its
    slot's cells (a prefix for the next request there), so they still count."""
    stats = engine.stats
    assert (stats.kv_cache_usage, stats.kv_block_size, stats.kv_num_blocks) == (0.0, 1, 64 * 2)
    await collect(engine, "hello", max_tokens=12)
    held = 5 + 12 - 1  # the prompt and the reply but its last token, which was sampled and never decoded
    assert engine.stats.kv_cache_usage == pytest.approx(held / 128)
    await collect(engine, "other words here", max_tokens=4)  # the other slot
    assert engine.stats.kv_cache_usage == pytest.approx((held + 16 + 4 - 1) / 128)


async def test_kv_cache_usage_counts_a_running_sequence() -> None:
    eng = BatchingEngine(FakeBackend(num_ctx=64, num_parallel=2, step_delay=0.02))
    try:
        stream = eng.submit(eng.tokenize("abcd"), SamplingParams(max_tokens=40))
        seen: list[float] = []
        streamed = 0
        async for chunk in stream:
            streamed += chunk.finish_reason is None
            if chunk.finish_reason is None and streamed == 10:  # (the engine thread may be a few tokens ahead)
                seen.append(eng.stats.kv_cache_usage or 0.0)
        assert seen and (4 + 9) / 128 <= seen[0] <= (4 + 40) / 128  # at least what was streamed, at most all of it
    finally:
        eng.close()


async def test_a_request_of_higher_priority_takes_the_slot_and_the_preempted_one_ends_as_it_would_have() -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=4096, num_parallel=1, step_delay=0.002), max_batch_tokens=64,
                            max_prefill_tokens=64)
    # long enough that the low request is still running when the high one comes, however late the loop reads
    alone, _ = await collect(engine, "batch line", max_tokens=600, priority=1000)
    low = engine.submit(engine.tokenize("batch line"), SamplingParams(max_tokens=600, priority=1000))
    low_chunks: list[Chunk] = []
    async for chunk in low:
        low_chunks.append(chunk)
        if len(low_chunks) == 10:
            break
    high_text, high_end = await collect(engine, "interactive", max_tokens=5, priority=0)
    async for chunk in low:
        low_chunks.append(chunk)
    assert high_text == FakeBackend.expected(len("interactive"), 5)
    assert "".join(c.text for c in low_chunks) == alone
    assert low_chunks[-1].finish_reason == "length"
    assert low_chunks[-1].usage is not None and low_chunks[-1].usage.prompt_tokens == len("batch line")
    assert engine.stats.preemptions == 1
    assert engine.cache_stats.hits["ram"] == 1  # it came back from its state, saved when the high one took the slot
    assert high_end.finish_reason == "length"
    engine.close()


async def test_scoring_sequences_are_decoded_each_in_a_batch_of_its_own() -> None:
    backend = FakeBackend(num_ctx=256, num_parallel=3)
    eng = BatchingEngine(backend, max_batch_tokens=64, max_prefill_tokens=64)
    try:
        prompts = [eng.tokenize(f"prompt number {i}") for i in range(3)]
        scoring = SamplingParams(temperature=0, max_tokens=1, score_tokens=[1, 2])
        finals = await asyncio.gather(_last(eng.submit(prompts[0], scoring)), _last(eng.submit(prompts[1], scoring)),
                                      _last(eng.submit(prompts[2], SamplingParams(max_tokens=4))))
        assert [len(f.scores) for f in finals] == [2, 2, 0]
        assert math.fsum(math.exp(v) for v in finals[0].scores) < 1
        scored = [step for step in backend.steps if any(e.tokens in prompts[:2] for e in step)]
        assert len(scored) == 2 and all(len(step) == 1 for step in scored)  # never sharing a decode call
    finally:
        eng.close()


async def test_a_free_slot_is_saved_while_the_engine_idles_not_on_the_path_of_the_request_that_takes_it() -> None:
    """As llama-server caches idle slots: once a request ends and nothing waits, its slot's state goes to the prompt
    cache; the next request with another prompt takes the slot without copying it first, and the first prompt,
    back, is restored from the cache."""
    backend = FakeBackend(num_ctx=512, num_parallel=1)
    engine = BatchingEngine(backend)
    saves: list[bool] = []  # per save: was a request running (the save on a request's path)?
    save_state = backend.save_state

    def recording_save(slot: int) -> bytes:
        saves.append(bool(engine.scheduler.running))
        return save_state(slot)

    backend.save_state = recording_save  # type: ignore[method-assign]
    first, other = "The first conversation. " * 8, "Another conversation entirely. " * 8
    try:
        await collect(engine, first, max_tokens=4)
        for _ in range(200):
            if saves:
                break
            await asyncio.sleep(0.01)
        assert saves == [False]
        await collect(engine, other, max_tokens=4)
        assert saves[1:2] != [True]  # the slot's earlier prompt was saved already: no copy on this request's path
        await collect(engine, first, max_tokens=4)
        assert engine.cache_stats.hits["ram"] == 1
    finally:
        engine.close()


@pytest.mark.parametrize(("priority", "saves"), [(0, 1), (1000, 0)])
async def test_a_batch_lines_state_is_not_saved_in_the_prompt_cache(priority: int, saves: int) -> None:
    """A batch's lines (priority above the default) do not come back: the slot one leaves is neither saved while the
    engine idles nor before the next prompt takes it, so a batch neither spends the engine's time on copies nor
    pushes users' conversations out of the cache."""
    backend = FakeBackend(num_ctx=512, num_parallel=1)
    engine = BatchingEngine(backend)
    saved: list[int] = []
    save_state = backend.save_state

    def recording_save(slot: int) -> bytes:
        saved.append(slot)
        return save_state(slot)

    backend.save_state = recording_save  # type: ignore[method-assign]
    try:
        await collect(engine, "A line of the batch. " * 8, max_tokens=4, priority=priority)
        await asyncio.sleep(0.5)  # past Bridge's quiet spell: an idle save happens here if any
        await collect(engine, "Another prompt entirely. " * 8, max_tokens=4)  # takes the slot
        assert len(saved) == saves
    finally:
        engine.close()
