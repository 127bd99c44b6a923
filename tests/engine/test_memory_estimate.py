"""What a load will hold in memory, told from headers before loading: the KV cache per token and the context as the
llama.cpp load itself decides them, the slots, a hybrid model's state; a vLLM repository roughly; and what the
machine has for it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import llama_cpp as lc
import pytest

from lmserve.engine.factory import estimate_memory
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.estimate import (
    bytes_per_value,
    estimate_gguf,
    header_kv_bytes_per_token,
    state_bytes_per_sequence,
)
from lmserve.engine.llamacpp.loading import init_llama_backend
from lmserve.engine.llamacpp.memory import KV_TYPE_BYTES, kv_bytes_per_token
from lmserve.engine.llamacpp.options import KV_CACHE_TYPES, LlamaCppLaunch
from lmserve.engine.memory_estimate import COMPUTE_BASE_BYTES, MemoryEstimate, _cgroup_room, available_memory
from lmserve.engine.vllm.memory import VLLM_RUNTIME_BYTES
from lmserve.store.gguf_check import gguf_metadata
from lmserve.types import AUTO_CONTEXT, LoadOptions
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import CONV_L_CACHE, NUM_EMBD, TINY, write_tiny_lfm2

HEADER = partial(gguf_metadata, max_array=4096)
GiB = 2**30
DEFAULTS = LlamaCppLaunch()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> dict[str, Path]:
    """SmolLM2, a tiny llama trained for 64k tokens and a tiny hybrid LFM2 (convolutions and attention)."""
    directory = tmp_path_factory.mktemp("estimate")
    return {"smollm2": model_path, "long": write_tiny_llama(directory / "long.gguf", n_ctx=65536),
            "lfm2": write_tiny_lfm2(directory / "lfm2.gguf")}


@pytest.mark.parametrize("name", ["smollm2", "long", "lfm2"])
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_the_kv_per_token_from_the_header_is_the_loaded_models(name: str, cache_type: str,
                                                                files: dict[str, Path]) -> None:
    path = files[name]
    launch = LlamaCppLaunch(cache_type_k=cache_type, cache_type_v=cache_type)
    init_llama_backend()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    try:
        assert header_kv_bytes_per_token(HEADER(path), launch) == kv_bytes_per_token(model, path, launch)
    finally:
        lc.llama_model_free(model)


@pytest.mark.parametrize(
    ("name", "options", "unified"),
    [
        ("smollm2", LoadOptions(num_ctx=AUTO_CONTEXT, num_parallel=4), False),
        ("smollm2", LoadOptions(num_ctx=32768, num_parallel=1), False),  # capped at the trained 8192
        ("long", LoadOptions(num_ctx=AUTO_CONTEXT, num_parallel=2), False),
        ("long", LoadOptions(num_ctx=4096, num_parallel=3), True),
        ("lfm2", LoadOptions(num_ctx=AUTO_CONTEXT, num_parallel=2), False),
    ],
)
def test_the_context_is_the_one_the_load_chooses(name: str, options: LoadOptions, unified: bool,
                                                 files: dict[str, Path]) -> None:
    launch = LlamaCppLaunch(kv_unified=unified)
    estimate = estimate_gguf(files[name], options, launch, HEADER)
    backend = LlamaCppBackend(files[name], options, launch)
    try:
        assert estimate.num_ctx == backend.info.num_ctx
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("options", "unified", "cells"),
    [
        (LoadOptions(num_ctx=512, num_parallel=2), False, 1024),  # every slot its own context
        (LoadOptions(num_ctx=2048, num_parallel=4), False, 8192),
        (LoadOptions(num_ctx=2048, num_parallel=4), True, 2048),  # one pool for all of them
    ],
)
def test_the_kv_cache_is_a_token_times_the_context_times_the_slots(options: LoadOptions, unified: bool, cells: int,
                                                                   files: dict[str, Path]) -> None:
    path = files["smollm2"]
    launch = LlamaCppLaunch(kv_unified=unified)
    estimate = estimate_gguf(path, options, launch, HEADER)
    assert estimate.kv_bytes == header_kv_bytes_per_token(HEADER(path), launch) * cells
    assert estimate.weights_bytes == estimate.mapped_bytes == path.stat().st_size
    assert COMPUTE_BASE_BYTES < estimate.compute_bytes < COMPUTE_BASE_BYTES + 32 * 2**20
    assert estimate.total == estimate.weights_bytes + estimate.kv_bytes + estimate.compute_bytes
    assert not estimate.on_gpu


def test_a_hybrid_models_convolution_state_is_counted_per_slot(files: dict[str, Path]) -> None:
    path = files["lfm2"]
    options = LoadOptions(num_ctx=256, num_parallel=3)
    convolutions = sum(1 for kind in TINY.layer_types if "attention" not in kind)
    per_sequence = convolutions * (CONV_L_CACHE - 1) * NUM_EMBD * 4
    assert state_bytes_per_sequence(HEADER(path)) == per_sequence
    estimate = estimate_gguf(path, options, DEFAULTS, HEADER)
    assert estimate.kv_bytes == header_kv_bytes_per_token(HEADER(path), DEFAULTS) * 256 * 3 + per_sequence * 3


@pytest.mark.parametrize(
    ("options", "mapped", "on_gpu"),
    [
        (LoadOptions(use_mmap=False), False, False),  # read into memory: the kernel counts it used
        (LoadOptions(use_mlock=True), False, False),  # locked pages are not reclaimable
        (LoadOptions(num_gpu_layers=-1), True, True),
    ],
)
def test_how_the_weights_are_held(options: LoadOptions, mapped: bool, on_gpu: bool, files: dict[str, Path]) -> None:
    estimate = estimate_gguf(files["long"], options, DEFAULTS, HEADER)
    assert (estimate.mapped_bytes == estimate.weights_bytes, estimate.on_gpu) == (mapped, on_gpu)


def test_a_draft_model_and_a_projector_add_their_weights_and_kv(files: dict[str, Path]) -> None:
    options = LoadOptions(num_ctx=1024, num_parallel=2)
    alone = estimate_gguf(files["smollm2"], options, DEFAULTS, HEADER)
    draft = files["long"]
    both = estimate_gguf(files["smollm2"], LoadOptions(num_ctx=1024, num_parallel=2, projector=str(files["lfm2"])),
                         LlamaCppLaunch(model_draft=str(draft)), HEADER)
    assert both.weights_bytes == alone.weights_bytes + draft.stat().st_size + files["lfm2"].stat().st_size
    assert both.kv_bytes == alone.kv_bytes + header_kv_bytes_per_token(HEADER(draft), DEFAULTS) * 1024 * 2


@pytest.mark.parametrize(
    ("estimate", "text"),
    [
        (MemoryEstimate(GiB, 2 * GiB, GiB // 10, num_ctx=8192, num_slots=4),
         "1 GiB of weights, 2 GiB of KV cache for 4 slots x 8192 tokens and 0.1 GiB of buffers"),
        (MemoryEstimate(GiB, GiB // 2, 0, num_ctx=8192, num_slots=1),
         "1 GiB of weights, 0.5 GiB of KV cache for 1 slot x 8192 tokens and 0 GiB of buffers"),
        (MemoryEstimate(GiB, GiB // 2, 0, num_ctx=8192, num_slots=4, kv_unified=True),
         "1 GiB of weights, 0.5 GiB of KV cache for one pool of 8192 tokens shared by 4 slots and 0 GiB of buffers"),
    ],
)
def test_an_estimate_describes_itself(estimate: MemoryEstimate, text: str) -> None:
    assert estimate.describe() == text


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A repository of 2 attention layers of 4 KV heads of 64 values, its weights 1 MiB."""
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "hidden_size": 512, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2**20)
    return tmp_path


@pytest.mark.parametrize(
    ("is_cpu", "space", "kv", "on_gpu"),
    [
        (True, None, 64 * 2**20, False),  # 2 x 2 x 4 x 64 x 2 bytes x 1024 x 2 = 4 MiB, raised to vLLM's floor
        (True, "2", 2 * GiB, False),  # VLLM_CPU_KVCACHE_SPACE in GiB
        (False, None, 0, True),  # on a GPU: vLLM's own budget
    ],
)
def test_a_repository_is_estimated_roughly(repository: Path, is_cpu: bool, space: str | None, kv: int, on_gpu: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lmserve.engine.vllm.args.is_cpu_build", lambda: is_cpu)
    if space is None:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", space)
    estimate = estimate_memory(repository, LoadOptions(num_ctx=1024, num_parallel=2), HEADER)
    assert estimate is not None
    assert (estimate.weights_bytes, estimate.kv_bytes, estimate.on_gpu) == (2**20, kv, on_gpu)
    assert estimate.compute_bytes == (0 if on_gpu else VLLM_RUNTIME_BYTES)


def test_a_gguf_goes_to_the_llamacpp_estimate(files: dict[str, Path]) -> None:
    options = LoadOptions(num_ctx=512, num_parallel=2)
    assert estimate_memory(files["long"], options, HEADER) == estimate_gguf(files["long"], options, DEFAULTS, HEADER)


def test_the_machine_says_what_it_has() -> None:
    found = available_memory()
    assert found is not None and found > 0


@pytest.mark.parametrize(
    ("limit", "usage", "stat", "room"),
    [
        ("max", "100", "inactive_file 10\n", None),  # no limit
        ("1000", "600", "anon 500\ninactive_file 50\n", 450),  # the room, and the cache it may drop
        ("1000", "1200", "inactive_file 0\n", 0),
        ("9223372036854771712", "600", "", None),  # cgroup v1's "unlimited"
    ],
)
def test_a_control_groups_room(tmp_path: Path, limit: str, usage: str, stat: str, room: int | None) -> None:
    (tmp_path / "memory.max").write_text(limit + "\n")
    (tmp_path / "memory.current").write_text(usage + "\n")
    (tmp_path / "memory.stat").write_text(stat)
    assert _cgroup_room(tmp_path / "memory.max", tmp_path / "memory.current", "inactive_file") == room


@pytest.mark.parametrize("cache_type", KV_CACHE_TYPES)
def test_a_cache_types_bytes_per_value_are_llamacpps(cache_type: str) -> None:
    assert bytes_per_value(cache_type) == KV_TYPE_BYTES[cache_type]
