"""Every LFM2 member on each engine that runs it agrees with transformers' float32 forward pass
(tests/lfm2_reference.py).

Members (tests/hf_repos.py, one set of seeded weights each): `lfm2` (hybrid: conv, conv, attention, conv),
`lfm2-attention` (attention in every layer), `lfm2moe` (4 experts, top 2, expert bias; layer 0 dense) and `lfm2-vl`'s
text model. llama.cpp runs the GGUF llama.cpp's converter makes of the repository (float32 weights), vLLM and MLX
(mlx-lm; its CPU build here) the repository (bf16 weights computed in float32). For two multi-token prompts (a chat
turn; ~200 tokens of text) and 8 greedy steps, each step's top-5 log-probabilities must match and greedy tokens must
be the reference's where its top-2 margin exceeds the tolerance. Each prompt runs twice: on vLLM the long prompt's
second run starts from its prefix cache (128 tokens; a hybrid's saved convolution state), on llama.cpp both runs
compute the whole prompt, on MLX the second run restores the snapshot the first took at a checkpoint (16 and 128
tokens: CHECKPOINTS); MLX then runs both prompts at once, decoding them as one batch.

Tolerances, and why: the reference and the engines compute in float32 but sum in other orders (blocked matmuls,
fused kernels, threads), so logprobs differ by float32 rounding through 4 layers: measured ≤ 4.3e-6 on vLLM,
≤ 8.6e-6 on llama.cpp with a float32 KV cache and flash attention off and ≤ 1.0e-5 on MLX (OpenBLAS's products;
≤ 1.1e-5 with MLX's bundled BLAS), hence 1e-4 for all three (MLX computing in the repository's bf16: off by up to
0.1). llama.cpp's defaults (a float16 KV cache; flash attention "auto", on for the CPU) round keys and values to 11
bits (the CPU's flash attention does so even over a float32 cache: ~1e-3 in the logits): measured ≤ 1.5e-3, hence
2e-3. Not `ignore_eos`: llama.cpp bans the end-of-generation tokens for it, renormalizing every logprob.
A greedy token is only checked where the reference's top-2 margin exceeds the tolerance: closer than that, rounding
may pick either.

Before issue 17, vLLM's CPU build failed this from the second prompt token on (its rotary kernel misreads LFM2's
3-D query and key; lmserve turned it off for hybrids only, so the all-attention member still fails with the old
rule; now for the whole family, engine/vllm/args.py `CPU_ROPE_KERNEL_WRONG`), and the hybrid repository itself was
inconsistent (config.json described an FFN half as wide as its weights; lmserve now refuses such a repository,
engine/vllm/weights_check.py). llama.cpp cannot run the all-attention member at all (`LLAMA_CPP_ABORTS`), nor can
mlx-lm, which cannot load LFM2-VL's transformers repository either (`MLX_REFUSES`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import gguf
import pytest
import pytest_asyncio

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.mlx.backend import MlxBackend
from lmserve.engine.mlx.options import MlxLaunch
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.vllm.args import VllmOptions
from lmserve.engine.vllm.engine import VllmEngine
from lmserve.engine.vllm.vision import vision_support_missing
from lmserve.errors import InvalidRequest
from lmserve.store.gguf_check import check_gguf
from lmserve.types import Chunk, LoadOptions, SamplingParams
from tests.hf_repos import (
    ConverterMissing,
    lfm2_gguf,
    tiny_lfm2_attention_repo,
    tiny_lfm2_moe_repo,
    tiny_lfm2_repo,
    tiny_lfm2_vl_repo,
)
from tests.lfm2_reference import PROMPTS, STEPS, compare, prompt_ids, reference

pytestmark = pytest.mark.asyncio(loop_scope="module")  # vLLM's output handler lives on the loop that first used it

MEMBERS: dict[str, Callable[[], Path]] = {
    "lfm2": tiny_lfm2_repo, "lfm2-attention": tiny_lfm2_attention_repo, "lfm2moe": tiny_lfm2_moe_repo,
    "lfm2-vl": tiny_lfm2_vl_repo,
}
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=10)
"""Not ignore_eos (the logprobs are those of the distribution a token was drawn from, engine/logprobs.py, which
ignore_eos changes on llama.cpp); the random members never pick an end token in 8 steps."""
LLAMA_CPP_ABORTS = {
    "lfm2-attention": "llama.cpp (0c1e570) aborts the process on the first decode of an LFM2 without convolution "
                      "layers: GGML_ASSERT(buffer) in llm_graph_input_mem_hybrid::set_input (its hybrid memory's "
                      "recurrent part has no layers, hence no buffer)",
}
"""Members llama.cpp cannot run, and why (released LFM2s all have convolution layers)."""
MEASURED: dict[str, float] = {}
"""The largest |Δ| per member and engine, for the summary this module prints at its end (`-s`)."""
CACHED: dict[str, int] = {}
"""The prompt tokens each second run took from the engine's cache, for the summary."""
CHECKPOINTS = {"chat": 16, "long": 128}
"""Where a slot engine snapshots a hybrid's state when asked (`submit(checkpoints=)`, as the server does at the end
of a system prompt), so that the second run restores it: 16 is the least the scheduler shares (its `min_share`)."""


def gguf_of(repo: Path) -> Path:
    try:
        return lfm2_gguf(repo)
    except ConverterMissing as exc:
        pytest.skip(str(exc))


async def run(engine: BatchingEngine | VllmEngine, prompt: list[int],
              checkpoints: list[int] | None = None) -> tuple[list[int], list[dict[int, float]], int]:
    """The greedy reply's tokens, per token its alternatives' logprobs (its own included), and the prompt tokens
    the engine took from its cache."""
    chunks: list[Chunk] = [chunk async for chunk in engine.submit(prompt, GREEDY, checkpoints=checkpoints)]
    usage = chunks[-1].usage
    assert chunks[-1].finish_reason == "length" and usage is not None, chunks[-1]
    entries = [entry for chunk in chunks for entry in chunk.logprobs]
    alternatives = [{t.token: t.logprob for t in e.top} | {e.token: e.logprob} for e in entries]
    return [e.token for e in entries], alternatives, usage.cached_tokens


async def check_member(engine: BatchingEngine | VllmEngine, repo: Path, label: str, tolerance: float, *,
                       checkpoints: bool = False) -> None:
    """Each prompt twice (with `checkpoints`, snapshots at CHECKPOINTS for the second run to start from)."""
    worst = 0.0
    for name in PROMPTS:
        prompt = prompt_ids(repo, name)
        expected = reference(repo, prompt)
        for attempt in range(2):  # the second run may reuse the first one's cached prefix
            tokens, logprobs, cached = await run(engine, prompt, [CHECKPOINTS[name]] if checkpoints else None)
            worst = max(worst, compare(expected, tokens, logprobs, tolerance))
            if attempt:
                CACHED[f"{label} {name}"] = cached
    MEASURED[label] = worst


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    print("\nmax |Δ logprob| vs transformers float32:", json.dumps({k: f"{v:.1e}" for k, v in MEASURED.items()}))
    print("cached prompt tokens on the second run:", json.dumps(CACHED))


# ---- llama.cpp, from the converted GGUF -------------------------------------------------------------------------


@pytest.mark.parametrize(("kv", "flash_attn", "tolerance"), [("f32", "off", 1e-4), ("f16", "auto", 2e-3)],
                         ids=["f32-kv", "defaults"])
@pytest.mark.parametrize("member", [member for member in MEMBERS if member not in LLAMA_CPP_ABORTS])
async def test_llama_cpp_matches_transformers(member: str, kv: str, flash_attn: str, tolerance: float) -> None:
    repo = MEMBERS[member]()
    options = LoadOptions(num_ctx=1024, num_parallel=1)
    launch = LlamaCppLaunch(cache_type_k=kv, cache_type_v=kv, flash_attn=flash_attn)
    engine = BatchingEngine(LlamaCppBackend(gguf_of(repo), options, launch))
    try:
        await check_member(engine, repo, f"{member} llama.cpp {kv} KV, flash attention {flash_attn}", tolerance)
    finally:
        engine.close()


async def test_the_moe_gguf_has_no_output_norm_and_loads_and_answers() -> None:
    # The seed's failure: older runners looked for `output_norm.weight`, which LFM2-MoE's GGUF does not have (its
    # final norm is `token_embd_norm.weight`, as llama.cpp's lfm2moe graph reads it).
    path = gguf_of(tiny_lfm2_moe_repo())
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert "output_norm.weight" not in names and "token_embd_norm.weight" in names
    assert any(".ffn_gate_exps." in name for name in names) and "blk.1.exp_probs_b.bias" in names
    engine = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=512, num_parallel=1)))
    try:
        assert engine.info.architecture == "lfm2moe"
        prompt = engine.tokenize(PROMPTS["chat"], add_special=False)
        chunks = [c async for c in engine.submit(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                                        ignore_eos=True))]
        assert "".join(c.text for c in chunks).strip() and chunks[-1].finish_reason == "length"
    finally:
        engine.close()


async def test_an_lfm2_gguf_llama_cpp_would_abort_on_is_refused_before_it_loads() -> None:
    """The all-attention member (LLAMA_CPP_ABORTS) is refused by the check every GGUF passes before llama.cpp sees
    it (store/gguf_check.py), instead of the server process dying; the other members pass it."""
    with pytest.raises(InvalidRequest, match="an LFM2 without convolution layers"):
        check_gguf(gguf_of(tiny_lfm2_attention_repo()))
    for member in ("lfm2", "lfm2moe", "lfm2-vl"):
        check_gguf(gguf_of(MEMBERS[member]()))


# ---- vLLM, from the repository (one engine per member at a time) -----------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(MEMBERS))
async def vllm_member(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Path, VllmEngine]]:
    member: str = request.param
    repo = MEMBERS[member]()
    missing = vision_support_missing(json.loads((repo / "config.json").read_text()))
    if missing is not None:
        pytest.skip(f"vLLM cannot load {member} here (tests/engine/vllm/test_vision.py checks the refusal): {missing}")
    engine = VllmEngine(repo, VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32"))
    yield member, repo, engine
    engine.fail_all("the test is over")
    await asyncio.to_thread(engine.llm.shutdown)  # before the next member's engine starts: one vLLM at a time


async def test_vllm_matches_transformers(vllm_member: tuple[str, Path, VllmEngine]) -> None:
    member, repo, engine = vllm_member
    await check_member(engine, repo, f"{member} vLLM", 1e-4)
    assert CACHED[f"{member} vLLM long"] > 0  # the cached path was compared too (a hybrid: the saved conv state)


async def test_vllm_refuses_a_repository_whose_config_misdescribes_its_ffn(tmp_path: Path) -> None:
    # The recipe tests/hf_repos.py had before issue 17: weights with a 256-wide FFN, config.json saying 128.
    repo = shutil.copytree(tiny_lfm2_repo(), tmp_path / "misdescribed")
    config = json.loads((repo / "config.json").read_text())
    config.update(intermediate_size=config["intermediate_size"] // 2)
    (repo / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match=r"a width of 64 \(intermediate_size 64, .*\) but "
                                             r"model.layers.0.feed_forward.w1.weight in model.safetensors has 128"):
        VllmEngine(repo, VllmOptions(num_ctx=512, num_parallel=1, dtype="float32"))


# ---- MLX, from the repository (mlx-lm; float32, its CPU build here) ---------------------------------------------


MLX_REFUSES = {
    "lfm2-attention": "mlx-lm's lfm2 model fails on its first tokens \\(IndexError",
    "lfm2-vl": "lfm2_vl not supported",
}
"""Members mlx-lm (0.32.2) cannot run, and what the refusal names. Its `lfm2` model finds the masks by the cache of
the first convolution layer, so an LFM2 without one loads and then fails every forward pass (IndexError); it has
no `lfm2_vl` model type (its `lfm2-vl` reads MLX-converted checkpoints, whose weights are named otherwise)."""


def mlx_backend(repo: Path) -> MlxBackend:
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("mlx-lm is not installed (pip install 'lmserve[mlx]')")
    return MlxBackend(repo, LoadOptions(num_ctx=1024, num_parallel=2), MlxLaunch(mlx_dtype="float32"))


@pytest.mark.parametrize("member", [member for member in MEMBERS if member not in MLX_REFUSES])
async def test_mlx_matches_transformers(member: str) -> None:
    repo = MEMBERS[member]()
    engine = BatchingEngine(mlx_backend(repo))
    label = f"{member} MLX"
    try:
        assert engine.info.description.startswith("MLX float32")  # the repository's bf16 weights, computed in f32
        await check_member(engine, repo, label, 1e-4, checkpoints=True)
        # Both prompts at once: their slots decode as one batch (caches of two lengths, left-padded).
        prompts = [prompt_ids(repo, name) for name in PROMPTS]
        replies = await asyncio.gather(*(run(engine, prompt) for prompt in prompts))
        for prompt, (tokens, logprobs, _) in zip(prompts, replies, strict=True):
            MEASURED[label] = max(MEASURED[label], compare(reference(repo, prompt), tokens, logprobs, 1e-4))
    finally:
        engine.close()
    assert [CACHED[f"{label} {name}"] for name in PROMPTS] == list(CHECKPOINTS.values())  # restored snapshots


@pytest.mark.parametrize("member", list(MLX_REFUSES))
async def test_mlx_refuses_what_mlx_lm_cannot_run(member: str) -> None:
    with pytest.raises(InvalidRequest, match=MLX_REFUSES[member]):
        mlx_backend(MEMBERS[member]())
