#!/usr/bin/env python3
"""Speculative decoding on a hybrid LFM2: would restoring the state after a rejected draft beat refusing to draft?

A hybrid model's convolution state exists only for its last position, so a rejected draft cannot be cut off its
memory: the engine could refuse drafts for it (as it first did), or take the state restore path (as it does now,
engine/llamacpp/recurrent_state.py): save the slot's state before a drafted step, and after a rejection restore it
and decode
the pending and accepted tokens again. This measures, with the llama.cpp backend directly (`LlamaCppBackend`, one
slot, greedy, ``--threads`` threads, fixed), on random LFM2s written by the tests' generator (tests/tiny_lfm2.py:
the tiny one, and the LFM2-350M-shaped ``SMALL`` quantized to Q4_0; ``--shapes``), at a context of ``--context``
(512) tokens:

- plain: one decode step of 1 token (what refusing costs per token);
- drafted(k): one step of the pending token and k drafted ones, logits on every row (k = 1 … 8; the draft is
  rejected, so one row is sampled: with a real 65k vocabulary each further sampled row adds the sampler's cost);
- redecode(m): decoding m tokens again after a restore (the pending token and m - 1 accepted ones), no logits;
- the state copies: "partial" saves only the recurrent part (``llama_state_seq_get_data_ext`` with
  LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY; the attention cache is cut back with ``llama_memory_seq_rm``, which a hybrid
  memory allows once its recurrent cell is back before the cut), "full" is the engine's `save_state` /
  `restore_state` (attention cache too: what engine/snapshots.py keeps), whose size grows with the context.

Each of ``--reps`` rounds times all of them once per k, from the same context (the full state restored at its end).

It checks that the partial path is exact (after a rejected draft, restore and re-decode, the next 32 greedy tokens
equal plain decoding's), then prints the medians, the break-even acceptance rate for drafts of k = 2, 4, 8 (each
drafted token accepted with probability a, independently; the rate at which a drafted step's expected cost per
token equals a plain step's) for a model whose memory can be cut (no copies) and for the hybrid paths, and the
speed the hybrid paths would reach on the drafts our drafter makes on bench/speculative.py's copy and story
workloads: their (drafted, accepted) steps are recorded with SmolLM2 (``--model``, greedy, ``--draft-max`` 8,
``--max-tokens`` 200), and each step is priced with the LFM2's measured costs.

    python bench/hybrid_drafting.py [--shapes tiny,small] [--context 512] [--reps 24] [--draft-max 8]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as lc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import speculative
import throughput

sys.path.insert(0, str(throughput.ROOT))
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.llamacpp.quantize import quantize
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.sequence import Sequence
from lmserve.types import LoadOptions, SamplingParams
from tests.tiny_lfm2 import SMALL, write_tiny_lfm2

MAX_DRAFT = 8
SLOT, TWIN = 0, 1
PARTIAL = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
PATHS = ("cut", "partial", "folded", "full")


def lfm2_model(folder: Path, shape: str) -> Path:
    """The tiny random LFM2, or the LFM2-350M-shaped one quantized to Q4_0 (~100 MB)."""
    if shape == "tiny":
        return write_tiny_lfm2(folder / "tiny-lfm2.gguf")
    f32 = write_tiny_lfm2(folder / "small-lfm2-f32.gguf", name="small-lfm2", shape=SMALL)
    small = folder / "small-lfm2-q4_0.gguf"
    quantize(f32, small, "Q4_0")
    f32.unlink()
    return small


class Stopwatch:
    """Seconds between laps."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or the start)."""
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed


@dataclass
class Costs:
    """Median seconds of each operation on one slot."""

    plain: float
    drafted: dict[int, float]
    """k → a step of the pending token and k drafted ones."""
    redecode: dict[int, float]
    """m → decoding m tokens again after a restore."""
    save: dict[str, float]
    """"partial" / "full" → saving the slot's state."""
    restore: dict[str, float]
    """"partial" / "full" → restoring it (partial: with cutting the attention cache back)."""
    size: dict[str, int] = field(default_factory=dict)
    """"partial" / "full" → bytes of the saved state."""


class Slot:
    """One slot of a hybrid model, decoded step by step with greedy sampling."""

    def __init__(self, backend: LlamaCppBackend, slot: int, prompt: list[int]) -> None:
        self.backend, self.slot = backend, slot
        backend.start(slot, SamplingParams(temperature=0), prompt, 0)
        self.pos = 0
        for start in range(0, len(prompt), 64):
            chunk = prompt[start:start + 64]
            sampled = backend.step([BatchEntry(slot, chunk, self.pos, start + 64 >= len(prompt))])[0]
            self.pos += len(chunk)
        assert sampled is not None
        self.pending = sampled

    def step(self, draft: list[int] | None = None) -> int:
        """Decode the pending token (and `draft`, its rows sampled too); the sampled token becomes pending."""
        draft = draft or []
        sampled = self.backend.step([BatchEntry(self.slot, [self.pending, *draft], self.pos, True, draft=len(draft))])
        self.backend.take_drafted(self.slot)
        self.backend._redo.pop(self.slot, None)  # the backend rewound a rejected draft itself: this script redecodes
        self.pos += 1  # drafted tokens stay in the memory (a hybrid one refuses the cut) until restore_partial
        self.pending = sampled[0] or 0
        return self.pending

    def save_partial(self) -> bytes:
        ctx = self.backend._ctx  # a path the backend does not have: its internals
        size = lc.llama_state_seq_get_size_ext(ctx, self.slot, PARTIAL)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data_ext(ctx, buf, size, self.slot, PARTIAL)
        return ctypes.string_at(buf, written)

    def restore_partial(self, state: bytes, pos: int) -> None:
        """Put the recurrent state back to `state` (saved at `pos`) and cut the attention cache back to `pos`."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lc.llama_state_seq_set_data_ext(self.backend._ctx, buf, len(state), self.slot, PARTIAL) == 0:
            raise RuntimeError("partial restore failed")
        if not lc.llama_memory_seq_rm(self.backend._memory, self.slot, pos, -1):
            raise RuntimeError("the attention cache could not be cut after the partial restore")
        self.pos = pos

    def redecode(self, tokens: list[int]) -> None:
        """Decode `tokens` again after a restore (no logits: the next token was sampled in the drafted step)."""
        self.backend.step([BatchEntry(self.slot, tokens, self.pos, False)])
        self.pos += len(tokens)


def check_partial_path(backend: LlamaCppBackend, prompt: list[int]) -> bool:
    """After a drafted step whose draft is rejected at its second token, restoring the recurrent state, cutting the
    attention cache and decoding the pending and accepted tokens again continues exactly as plain decoding."""
    plain, spec = Slot(backend, SLOT, prompt), Slot(backend, TWIN, prompt)
    first = plain.pending
    accepted = plain.step()
    wrong = (accepted + 1) % 256
    saved, pos = spec.save_partial(), spec.pos
    spec.step([accepted, wrong, wrong])  # the model agrees with `accepted`, not with `wrong`
    spec.restore_partial(saved, pos)
    spec.redecode([first, accepted])
    spec.pending = plain.step()  # both have decoded the prompt, `first` and `accepted`: the same next token
    expected = [plain.pending] + [plain.step() for _ in range(31)]
    got = [spec.pending] + [spec.step() for _ in range(31)]
    return got == expected


def measure(path: Path, threads: int, context: int, reps: int) -> tuple[Costs, bool]:
    options = LoadOptions(num_ctx=context + 2048, num_parallel=2, num_batch=64, num_threads=threads)
    backend = LlamaCppBackend(path, options, LlamaCppLaunch(thread_policy="fixed"))
    try:
        prompt = backend.tokenize(("The survey of 1872 counted the parts of the lighthouse. " * 200), add_special=True,
                                  parse_special=False)[:context]
        exact = check_partial_path(backend, prompt)
        slot = Slot(backend, SLOT, prompt)
        start_pending = slot.pending
        plain: list[float] = []
        drafted: dict[int, list[float]] = {k: [] for k in range(1, MAX_DRAFT + 1)}
        redecode: dict[int, list[float]] = {m: [] for m in range(1, MAX_DRAFT + 1)}
        saves: dict[str, list[float]] = {"partial": [], "full": []}
        restores: dict[str, list[float]] = {"partial": [], "full": []}
        sizes: dict[str, int] = {}
        watch = Stopwatch()
        for _ in range(reps):
            start = backend.save_state(SLOT)  # each round starts at the same context (restored at its end)
            saves["full"].append(watch.lap())
            sizes["full"] = len(start)
            for k in range(1, MAX_DRAFT + 1):
                watch.lap()
                slot.step()
                plain.append(watch.lap())
                pending, pos = slot.pending, slot.pos
                state = slot.save_partial()
                saves["partial"].append(watch.lap())
                sizes["partial"] = len(state)
                draft = [(pending + i + 1) % 256 for i in range(k)]  # rejected, as a rule: what is sampled is moot
                slot.step(draft)
                drafted[k].append(watch.lap())
                slot.restore_partial(state, pos)
                restores["partial"].append(watch.lap())
                slot.redecode([pending, *draft[:k - 1]])  # as if the draft's last token were rejected
                redecode[k].append(watch.lap())
            watch.lap()
            backend.restore_state(SLOT, start)
            restores["full"].append(watch.lap())
            slot.pos, slot.pending = len(prompt), start_pending
        costs = Costs(statistics.median(plain), {k: statistics.median(v) for k, v in drafted.items()},
                      {m: statistics.median(v) for m, v in redecode.items()},
                      {name: statistics.median(v) for name, v in saves.items()},
                      {name: statistics.median(v) for name, v in restores.items()}, sizes)
        return costs, exact
    finally:
        backend.close()


def step_cost(costs: Costs, path: str, k: int, taken: int) -> float:
    """Seconds of one step drafting `k` tokens of which `taken` were accepted, on `path` ("cut": a model whose
    memory can be cut; "partial"/"full": the hybrid restore path; "folded": the partial one with the re-decoded
    tokens added to the next step instead of a step of their own, estimated at a drafted row's cost each)."""
    if path == "cut":
        return costs.drafted[k]
    if path == "folded":  # partial, the tokens decoded again riding in the next step: each at a batch row's cost
        cost = costs.save["partial"] + costs.drafted[k]
        row = (costs.drafted[MAX_DRAFT] - costs.plain) / MAX_DRAFT
        return cost + (costs.restore["partial"] + (1 + taken) * row if taken < k else 0.0)
    cost = costs.save[path] + costs.drafted[k]
    if taken < k:
        cost += costs.restore[path] + costs.redecode[1 + taken]
    return cost


def break_even(costs: Costs, path: str, k: int) -> float | None:
    """The per-token acceptance rate at which drafts of `k` cost as much per token as plain steps (None: never)."""

    def gain(rate: float) -> float:
        chances = [rate**j * (1 - rate) for j in range(k)] + [rate**k]  # P(j accepted), j = 0 … k
        cost = sum(p * step_cost(costs, path, k, j) for j, p in enumerate(chances))
        tokens = sum(p * (1 + j) for j, p in enumerate(chances))
        return tokens * costs.plain - cost

    if gain(1.0) <= 0:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (low, middle) if gain(middle) > 0 else (middle, high)
    return high


class RecordingEngine(BatchingEngine):
    """The batching engine, recording each drafted step's (drafted, accepted) tokens."""

    steps: list[tuple[int, int]]

    def _drafted(self, seq: Sequence, drafted: int, taken: int) -> None:
        self.steps.append((drafted, taken))
        super()._drafted(seq, drafted, taken)


@dataclass
class Trace:
    workload: str
    tokens: int
    drafted_steps: list[tuple[int, int]]

    @property
    def plain_steps(self) -> int:
        """Decode steps without a draft (the first token comes from the prompt's step)."""
        return self.tokens - 1 - sum(1 + taken for _, taken in self.drafted_steps)


def record_traces(model: Path, threads: int, draft_max: int, max_tokens: int) -> list[Trace]:
    """Our drafter's steps on bench/speculative.py's copy and story prompts (one stream each, greedy)."""
    options = LoadOptions(num_ctx=2048, num_parallel=1, num_threads=threads)
    engine = RecordingEngine(LlamaCppBackend(model, options), draft_max=draft_max)
    traces = []
    try:
        for workload in ("copy", "story"):
            engine.steps = []
            text = f"<|im_start|>user\n{speculative.prompts(workload, 1)[0]}<|im_end|>\n<|im_start|>assistant\n"

            async def reply(text: str = text) -> int:
                stream = engine.submit(engine.tokenize(text), SamplingParams(temperature=0, max_tokens=max_tokens))
                async for _ in stream:
                    pass
                return len(stream.output_tokens)

            tokens = asyncio.run(reply())
            traces.append(Trace(workload, tokens, list(engine.steps)))
    finally:
        engine.close()
    return traces


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=24)
    parser.add_argument("--draft-max", type=int, default=MAX_DRAFT)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = throughput.parse_bench_args(parser)
    traces = record_traces(args.model, args.threads, min(args.draft_max, MAX_DRAFT), args.max_tokens)
    print(f"drafts of our drafter (SmolLM2 {args.model.name}, greedy, draft-max {args.draft_max}, "
          f"{args.max_tokens} tokens):")
    for trace in traces:
        drafted = sum(k for k, _ in trace.drafted_steps)
        taken = sum(a for _, a in trace.drafted_steps)
        whole = sum(1 for k, a in trace.drafted_steps if a == k)
        steps = trace.plain_steps + len(trace.drafted_steps)
        per_step = (trace.tokens - 1) / max(1, steps)
        print(f"  {trace.workload:5s}: {trace.tokens} tokens in {steps} steps ({per_step:.2f} tokens/step); "
              f"{len(trace.drafted_steps)} drafted steps, {drafted} tokens drafted, {taken} accepted "
              f"({taken / max(1, drafted):.0%}), {whole} drafts taken whole")
    with tempfile.TemporaryDirectory(prefix="lmserve-bench-hybrid-") as tmp:
        for shape in args.shapes.split(","):
            path = lfm2_model(Path(tmp), shape)
            costs, exact = measure(path, args.threads, args.context, args.reps)
            report(shape, path, costs, exact, traces, args)
    return 0


def report(shape: str, path: Path, costs: Costs, exact: bool, traces: list[Trace], args: argparse.Namespace) -> None:
    ms = 1000.0
    print(f"\nLFM2 {shape} ({path.name}, {path.stat().st_size / 2**20:.1f} MiB), context {args.context}, "
          f"{args.threads} threads, medians of {args.reps}; partial restore path exact: {exact}")
    print(f"  plain step {costs.plain * ms:.2f} ms; drafted(k) " +
          " ".join(f"{k}:{v * ms:.2f}" for k, v in costs.drafted.items()) + " ms; redecode(m) " +
          " ".join(f"{m}:{v * ms:.2f}" for m, v in costs.redecode.items()) + " ms")
    for name in ("partial", "full"):
        print(f"  {name} state: {costs.size[name] / 1024:.1f} KiB, save {costs.save[name] * ms:.3f} ms, "
              f"restore {costs.restore[name] * ms:.3f} ms")
    print("  break-even acceptance rate per drafted token (lower is better; '-' never pays):")
    for path_name in PATHS:
        cells = []
        for k in (2, 4, 8):
            rate = break_even(costs, path_name, k)
            cells.append(f"k={k} {'-' if rate is None else f'{rate:.2f}'}")
        print(f"    {path_name:7s}: " + ", ".join(cells))
    print("  our drafts priced with these costs (speed vs refusing to draft = plain steps only):")
    for trace in traces:
        refuse = (trace.tokens - 1) * costs.plain
        cells = []
        for path_name in PATHS:
            total = trace.plain_steps * costs.plain + sum(step_cost(costs, path_name, k, a)
                                                         for k, a in trace.drafted_steps)
            cells.append(f"{path_name} {refuse / total:.2f}x")
        print(f"    {trace.workload:5s}: " + ", ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
