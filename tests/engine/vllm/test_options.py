"""The vLLM engine's mapping of lmserve's options to vLLM's, written once (pure: no engine is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine import vllm
from lmserve.engine.sampling_support import refuse_unhonoured
from lmserve.engine.vllm.args import VllmOptions, check_kv_offloading, engine_args
from lmserve.engine.vllm.memory import kv_bytes_per_token, kv_cache_bytes
from lmserve.engine.vllm.sampling import to_vllm_sampling
from lmserve.engine.vllm.workers import cpu_binding
from lmserve.errors import InvalidRequest
from lmserve.types import SamplingParams


def test_launch_options_map_to_vllm_engine_arguments() -> None:
    options = VllmOptions(num_ctx=2048, num_parallel=16, dtype="float16", tensor_parallel_size=2,
                          pipeline_parallel_size=2, data_parallel_size=1, torch_compile=False, prefill_chunk=512,
                          is_cpu=False)
    args = engine_args(Path("/m"), options, kv_bytes=2**28)
    assert args | {"model": "/m"} == args
    assert (args["max_model_len"], args["max_num_seqs"], args["dtype"]) == (2048, 16, "float16")
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (2, 2)
    assert args["enforce_eager"] is True and args["enable_prefix_caching"] is True
    assert args["kv_cache_memory_bytes"] == 2**28 and "gpu_memory_utilization" not in args
    assert (args["enable_chunked_prefill"], args["max_num_batched_tokens"]) == (True, 512)
    assert args["mamba_cache_dtype"] == "float16"  # a hybrid model's conv state follows --dtype float16


@pytest.mark.parametrize(("options", "expected"), [
    (VllmOptions(), {}),
    (VllmOptions(torch_compile=True), {"enforce_eager": False}),
    (VllmOptions(prefill_chunk=-1, num_ctx=4096), {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}),
    (VllmOptions(gpu_memory_utilization=0.5), {"gpu_memory_utilization": 0.5}),
    (VllmOptions(executor="ray"), {"distributed_executor_backend": "ray"}),
    (VllmOptions(nnodes=2, node_rank=1, master_addr="10.0.0.1"),
     {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29501}),
    (VllmOptions(pipeline_parallel_size=2), {"enforce_eager": False, "compilation_config": {"mode": 2,
                                                                                            "backend": "eager"}}),
    (VllmOptions(pipeline_parallel_size=2, is_cpu=False), {"enforce_eager": True}),
    (VllmOptions(kv_offloading_size=2.5, is_cpu=False), {"kv_offloading_size": 2.5, "kv_offloading_backend": "native"}),
    (VllmOptions(kv_offloading_size=8, kv_offloading_backend="lmcache", is_cpu=False),
     {"kv_offloading_size": 8, "kv_offloading_backend": "lmcache"}),
])
def test_each_option_reaches_vllm_only_when_given(options: VllmOptions, expected: dict[str, object]) -> None:
    args = engine_args(Path("/m"), options, kv_bytes=None)
    assert {key: args[key] for key in expected} == expected
    if not options.prefill_chunk:
        assert "max_num_batched_tokens" not in args and "enable_chunked_prefill" not in args
    if options.dtype == "auto":
        assert "mamba_cache_dtype" not in args
    if not options.kv_offloading_size:
        assert "kv_offloading_size" not in args and "kv_offloading_backend" not in args


@pytest.mark.parametrize(("options", "lmcache_installed", "refusal"), [
    (VllmOptions(), False, None),  # nothing asked: the CPU build is fine
    (VllmOptions(kv_offloading_size=4), False, "this machine runs vLLM's CPU build, whose KV cache"),
    (VllmOptions(kv_offloading_size=4, kv_offloading_backend="lmcache"), True, "vLLM's CPU build"),
    (VllmOptions(kv_offloading_size=4, is_cpu=False), False, None),
    (VllmOptions(kv_offloading_size=4, kv_offloading_backend="lmcache", is_cpu=False), False,
     "needs the LMCache package"),
    (VllmOptions(kv_offloading_size=4, kv_offloading_backend="lmcache", is_cpu=False), True, None),
])
def test_kv_offloading_is_refused_where_vllm_cannot_offload(options: VllmOptions, lmcache_installed: bool,
                                                             refusal: str | None) -> None:
    if refusal is None:
        check_kv_offloading(options, lmcache_installed=lmcache_installed)
        return
    with pytest.raises(InvalidRequest, match=refusal):
        check_kv_offloading(options, lmcache_installed=lmcache_installed)


def test_the_cpu_kv_cache_holds_parallel_times_context_for_attention_layers_only() -> None:
    hybrid = {"num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"],
              "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    options = VllmOptions(num_ctx=32768, num_parallel=64)
    assert kv_cache_bytes(hybrid, options, None) == 2 * 1 * 2 * 64 * 2 * 32768 * 64  # K and V, 1 layer, bf16
    assert kv_cache_bytes(hybrid, options, 2**30) == 2**29  # at most half of what is available
    assert kv_cache_bytes(hybrid, VllmOptions(num_ctx=16, num_parallel=1), None) == 64 * 2**20  # the floor


@pytest.mark.parametrize(
    ("config", "dtype", "expected"),
    [
        ({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}, "auto",
         2 * 30 * 3 * 64 * 2),  # SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64, 16-bit
        ({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576},
         "float32", 2 * 30 * 3 * 64 * 4),
        ({"text_config": {"num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"],
                          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}}, "bfloat16",
         2 * 1 * 2 * 32 * 2),  # a hybrid vision model's text config: its one attention layer
    ],
)
def test_the_kv_cache_per_token_counts_attention_layers(config: dict[str, object], dtype: str, expected: int) -> None:
    assert kv_bytes_per_token(config, dtype) == expected


def test_sampling_maps_once_with_top_k_zero_as_disabled() -> None:
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, repeat_penalty=1.1, seed=3,
                              max_tokens=None, stop=["\n\n"], logit_bias={5: -100.0})
    kwargs = to_vllm_sampling(sampling, special=True, room=100)
    assert kwargs["top_k"] == -1 and kwargs["max_tokens"] == 100 and kwargs["repetition_penalty"] == 1.1
    assert kwargs["skip_special_tokens"] is False and kwargs["stop"] == ["\n\n"] and kwargs["logit_bias"] == {5: -100.0}
    assert to_vllm_sampling(SamplingParams(top_k=40, max_tokens=500), special=False, room=100)["max_tokens"] == 100


@pytest.mark.parametrize(("sampling", "param"), [
    (SamplingParams(mirostat=2), "mirostat"),
    (SamplingParams(typical_p=0.5), "typical_p"),
    (SamplingParams(draft_max=4), "draft_max"),
])
def test_samplers_vllm_lacks_are_a_400(sampling: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        refuse_unhonoured(sampling, vllm.SPEC)  # its SPEC's `sampling` (engine/sampling_support.py)
    assert info.value.param == param


@pytest.mark.parametrize(("cpus", "workers", "binding"), [
    ([0, 1], 2, "0|1"),
    ([0, 1, 2, 3], 2, "0,1|2,3"),
    ([4, 5, 6, 7, 8], 2, "4,5|6,7"),
])
def test_cpu_workers_get_an_even_share_of_the_cores(cpus: list[int], workers: int, binding: str) -> None:
    assert cpu_binding(cpus, workers) == binding


def test_more_cpu_workers_than_cores_is_a_400() -> None:
    with pytest.raises(InvalidRequest, match="4 CPU workers"):
        cpu_binding([0, 1], 4)


HYBRID = {"model_type": "lfm2", "layer_types": ["conv", "full_attention"], "num_attention_heads": 2}


def test_a_hybrid_model_on_the_cpu_takes_the_exact_rotary_embedding() -> None:
    assert engine_args(Path("/m"), VllmOptions(), config=HYBRID)["compilation_config"] == {
        "custom_ops": ["-rotary_embedding"]}
    assert "compilation_config" not in engine_args(Path("/m"), VllmOptions(is_cpu=False), config=HYBRID)
    assert "compilation_config" not in engine_args(Path("/m"), VllmOptions(), config={"model_type": "llama"})


def test_whole_prompt_prefill_turns_off_prefix_caching_for_a_hybrid_model_only() -> None:
    whole = VllmOptions(prefill_chunk=-1)
    assert engine_args(Path("/m"), whole, config=HYBRID)["enable_prefix_caching"] is False
    assert engine_args(Path("/m"), whole, config={"model_type": "llama"})["enable_prefix_caching"] is True


def test_an_encoder_decoder_model_caches_no_prefix_and_takes_its_encoders_input_in_one_step() -> None:
    whisper = {"model_type": "whisper", "is_encoder_decoder": True, "max_source_positions": 1500}
    args = engine_args(Path("/m"), VllmOptions(num_ctx=448, prefill_chunk=256), config=whisper)
    assert args["enable_prefix_caching"] is False and args["max_num_batched_tokens"] == 2048
    assert "enable_chunked_prefill" not in args  # vLLM turns chunking off for it; a chunk size is not asked for
    big = {**whisper, "max_source_positions": 3000}
    assert engine_args(Path("/m"), VllmOptions(num_ctx=448), config=big)["max_num_batched_tokens"] == 3000
