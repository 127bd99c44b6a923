"""Speculative decoding keeps the target distribution when sampling: a statistical test on a tiny model whose
next-token distribution is known exactly.

The model (`write_chain_llama`) is a Markov chain over four letter tokens: attention and feed-forward layers add
nothing (zero output weights), so the last hidden state is the current token's embedding, and the output matrix
turns it into the logits of `CHAIN`. The prompt repeats "a b c d", so prompt lookup drafts "a b" after the first
reply token (always "d"); the model accepts "a" half the time. Every reply's tokens after the drafted position
are counted and compared with the chain's probabilities by a chi-square test (`chi_square_p`): with the engine's
rule (sample every row, accept a drafted token only when the sample equals it) the replies are the chain's, the
third and fourth tokens sampled from the drafted rows whenever the draft was taken; a rule that favours the draft
is caught by the same check (`test_the_check_passes_the_right_rule_and_fails_a_biased_one`).

False alarms: the engine test fails when p < ALPHA = 1e-4, so a correct engine would fail for one seed list in
10,000 (an off-chain token, which fails at once, has probability < 1e-12 in all the replies); the seed list is
fixed, so the outcome is deterministic (p = 0.30 on this build; the biased rule of the unit test gives 2e-14).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.bridge import RequestStream
from lmserve.types import LoadOptions, SamplingParams
from tests.tiny_gguf import (
    NUM_EMBD,
    NUM_FF,
    NUM_HEAD,
    NUM_HEAD_KV,
    NUM_LAYER,
    finish_gguf,
    tiny_vocab,
    write_llama_metadata,
)

N_VOCAB = 320
CHAIN: dict[str, dict[str, float]] = {
    "a": {"b": 0.6, "c": 0.25, "a": 0.15},
    "b": {"c": 0.7, "a": 0.3},
    "c": {"d": 1.0},
    "d": {"a": 0.5, "b": 0.3, "d": 0.2},
}
"""The next-token probabilities after each letter (every other token has probability < 1e-15)."""
OFF_CHAIN_LOGIT = -40.0
PROMPT = "abcd" * 6 + "abc"
"""Ends with "c", so the first reply token is "d"; "a b" followed "b c d" before, so that is the next draft."""
REPLY_TOKENS = 4
"""Four tokens: "d", then a step with the draft "a b" (all the limit allows), then what the draft left."""
NUM_SAMPLES = 800
ALPHA = 1e-4
MIN_EXPECTED = 5.0
"""Cells expected fewer times than this are pooled into one (the chi-square approximation needs counts)."""

Reply = tuple[str, ...]


def write_chain_llama(path: Path) -> Path:
    """A llama GGUF (F32) whose next-token distribution after each letter of CHAIN is CHAIN's row."""
    tokens, _, _ = tiny_vocab(N_VOCAB)
    embedding = np.zeros((N_VOCAB, NUM_EMBD), dtype=np.float32)
    output = np.zeros((N_VOCAB, NUM_EMBD), dtype=np.float32)
    # the final RMS norm turns the embedding e_i into e_i * scale; the output column i carries letter i's logits
    scale = 1.0 / math.sqrt(1.0 / NUM_EMBD + 1e-5)
    for i, letter in enumerate(CHAIN):
        embedding[tokens.index(letter), i] = 1.0
        logits = np.full(N_VOCAB, OFF_CHAIN_LOGIT)
        for after, p in CHAIN[letter].items():
            logits[tokens.index(after)] = math.log(p)
        output[:, i] = logits / scale

    def zeros(rows: int, cols: int) -> np.ndarray:
        return np.zeros((rows, cols), dtype=np.float32)

    ones = np.ones(NUM_EMBD, dtype=np.float32)
    head_dim = NUM_EMBD // NUM_HEAD
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", embedding)]
    for i in range(NUM_LAYER):
        tensors += [
            (f"blk.{i}.attn_norm.weight", ones),
            (f"blk.{i}.attn_q.weight", zeros(NUM_HEAD * head_dim, NUM_EMBD)),
            (f"blk.{i}.attn_k.weight", zeros(NUM_HEAD_KV * head_dim, NUM_EMBD)),
            (f"blk.{i}.attn_v.weight", zeros(NUM_HEAD_KV * head_dim, NUM_EMBD)),
            (f"blk.{i}.attn_output.weight", zeros(NUM_EMBD, NUM_HEAD * head_dim)),
            (f"blk.{i}.ffn_norm.weight", ones),
            (f"blk.{i}.ffn_gate.weight", zeros(NUM_FF, NUM_EMBD)),
            (f"blk.{i}.ffn_up.weight", zeros(NUM_FF, NUM_EMBD)),
            (f"blk.{i}.ffn_down.weight", zeros(NUM_EMBD, NUM_FF)),
        ]
    tensors += [("output_norm.weight", ones), ("output.weight", output)]
    writer = gguf.GGUFWriter(path, "llama")
    write_llama_metadata(writer, N_VOCAB, gguf.LlamaFileType.ALL_F32, "chain-llama", None)
    finish_gguf(writer, tensors)
    return path


def reply_probabilities(last: str, length: int) -> dict[Reply, float]:
    """The probability of every reply of `length` tokens after a prompt ending with `last`, by the chain."""
    replies: dict[Reply, float] = {(): 1.0}
    for _ in range(length):
        longer: dict[Reply, float] = {}
        for reply, p in replies.items():
            for after, q in CHAIN[reply[-1] if reply else last].items():
                longer[(*reply, after)] = p * q
        replies = longer
    return replies


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for a chi-square variable X with `dof` degrees of freedom (the regularized upper
    incomplete gamma function Q(dof/2, statistic/2), as 1 minus the series of the lower one: exact to ~1e-15
    absolute, enough for tests at p ~ 1e-4)."""
    a, x = dof / 2, statistic / 2
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-17:
        term *= x / (a + n)
        total += term
        n += 1
    lower = total * math.exp(a * math.log(x) - x - math.lgamma(a))
    return max(0.0, 1.0 - lower)


def chi_square_p(observed: Counter[Reply], expected: dict[Reply, float]) -> float:
    """The p-value of Pearson's chi-square test of `observed` counts against the probabilities `expected`.

    Cells expected fewer than MIN_EXPECTED times, and replies that `expected` does not list, are pooled into one
    cell; a reply `expected` calls impossible (no pooled probability) gives p = 0.
    """
    total = sum(observed.values())
    kept = {reply for reply, p in expected.items() if p * total >= MIN_EXPECTED}
    cells = [(observed[reply], expected[reply] * total) for reply in kept]
    pooled_count = total - sum(count for count, _ in cells)
    pooled_expected = total - sum(e for _, e in cells)
    if pooled_expected * 1e6 > total:  # pool only what has a real probability; beyond it, float noise
        cells.append((pooled_count, pooled_expected))
    elif pooled_count:
        return 0.0
    statistic = sum((count - e) ** 2 / e for count, e in cells)
    return chi_square_sf(statistic, len(cells) - 1)


def total_variation(observed: Counter[Reply], expected: dict[Reply, float]) -> float:
    """Half the L1 distance between the empirical distribution of `observed` and `expected`."""
    total = sum(observed.values())
    replies = set(observed) | set(expected)
    return 0.5 * sum(abs(observed[r] / total - expected.get(r, 0.0)) for r in replies)


# ---- the checking function, on simulated samplers (no engine) -----------------------------------------------------


def sample(rng: random.Random, previous: str) -> str:
    """The next token after `previous`, drawn from the chain."""
    row = CHAIN[previous]
    return rng.choices(list(row), weights=list(row.values()))[0]


def simulate(verify: Callable[[random.Random, str, str], str], rng: random.Random) -> Reply:
    """One reply of REPLY_TOKENS tokens after PROMPT by a speculative sampler with the draft "a b" after "d".

    `verify(rng, previous, drafted)` gives the token after `previous` in a step that drafted `drafted`; the draft
    goes on while it equals the draft, then plain sampling takes over.
    """
    reply = ["d"]  # CHAIN["c"] is certain
    for drafted in "ab":
        reply.append(verify(rng, reply[-1], drafted))
        if reply[-1] != drafted:
            break
    while len(reply) < REPLY_TOKENS:
        reply.append(sample(rng, reply[-1]))
    return tuple(reply)


def sample_then_compare(rng: random.Random, previous: str, drafted: str) -> str:
    """The engine's rule: the token is a sample from the model; the draft is accepted when it equals it."""
    return sample(rng, previous)


def favour_the_draft(rng: random.Random, previous: str, drafted: str) -> str:
    """A wrong rule: take the draft with probability max(p, 0.5), else sample (so a draft the model gives 0.5 or
    less comes out more often than the model says)."""
    return drafted if rng.random() < max(CHAIN[previous].get(drafted, 0.0), 0.5) else sample(rng, previous)


def test_the_check_passes_the_right_rule_and_fails_a_biased_one() -> None:
    expected = reply_probabilities("c", REPLY_TOKENS)
    assert math.isclose(sum(expected.values()), 1.0)
    correct = Counter(simulate(sample_then_compare, random.Random(seed)) for seed in range(NUM_SAMPLES))
    biased = Counter(simulate(favour_the_draft, random.Random(seed)) for seed in range(NUM_SAMPLES))
    assert chi_square_p(correct, expected) > ALPHA
    assert chi_square_p(biased, expected) < ALPHA
    assert chi_square_p(Counter({("d", "c", "d", "a"): 1, **correct}), expected) == 0.0  # an impossible reply


def test_the_chi_square_tail_matches_its_closed_forms() -> None:
    for x in (0.5, 3.0, 15.137, 40.0, 80.0):
        assert chi_square_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
        for dof in (2, 4, 14):  # even: exp(-x/2) * sum of (x/2)^k / k! for k < dof/2
            closed = math.exp(-x / 2) * sum((x / 2) ** k / math.factorial(k) for k in range(dof // 2))
            assert chi_square_sf(x, dof) == pytest.approx(closed, rel=1e-6, abs=1e-12)  # 1 - P: absolute precision


# ---- the engine ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchingEngine]:
    path = write_chain_llama(tmp_path_factory.mktemp("chain") / "chain.gguf")
    options = LoadOptions(num_ctx=64, num_parallel=8, num_batch=64)
    engine = BatchingEngine(LlamaCppBackend(path, options), max_queue=NUM_SAMPLES, draft_max=4)
    yield engine
    engine.close()


def letters(engine: BatchingEngine, text: str) -> list[int]:
    return [engine.tokenize(letter, add_special=False, parse_special=False)[-1] for letter in text]


async def test_the_model_has_the_chains_distribution(chain_engine: BatchingEngine) -> None:
    prompt = letters(chain_engine, PROMPT)
    assert len(prompt) == len(PROMPT)
    stream = chain_engine.submit(prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=4))
    logprobs = [logprob async for chunk in stream for logprob in chunk.logprobs]
    previous = "c"
    for logprob in logprobs:
        reported = {alt.text: alt.logprob for alt in logprob.top if alt.logprob > OFF_CHAIN_LOGIT / 2}
        assert reported == pytest.approx({after: math.log(p) for after, p in CHAIN[previous].items()}, abs=1e-4)
        previous = logprob.text
    assert len(logprobs) == 6


async def test_sampled_replies_with_drafts_keep_the_models_distribution(chain_engine: BatchingEngine) -> None:
    prompt = letters(chain_engine, PROMPT)
    streams = [chain_engine.submit(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=REPLY_TOKENS,
                                                          draft_max=4))
               for seed in range(NUM_SAMPLES)]

    async def read(stream: RequestStream) -> tuple[Reply, int, int]:
        chunks = [chunk async for chunk in stream]
        usage = chunks[-1].usage
        assert usage is not None
        reply = tuple(chain_engine.detokenize([token]) for token in stream.output_tokens)
        return reply, usage.draft_tokens, usage.draft_accepted_tokens

    results = await asyncio.gather(*(read(stream) for stream in streams))
    # every reply drafted "a b" after its first token "d" (the only draft 4 tokens leave room for), and the model
    # accepted as much of it as its own samples agreed with: "a" half the time, then "b" 60 % of those
    for reply, drafted, accepted in results:
        assert drafted == 2
        assert accepted == (2 if reply[1:3] == ("a", "b") else 1 if reply[1] == "a" else 0)
    accepted = sum(count for _, _, count in results)
    assert 0 < accepted < 2 * NUM_SAMPLES
    replies = Counter(reply for reply, _, _ in results)
    expected = reply_probabilities("c", REPLY_TOKENS)
    p = chi_square_p(replies, expected)
    assert p > ALPHA, f"p = {p:.2g}, total variation {total_variation(replies, expected):.3f}: {replies}"
