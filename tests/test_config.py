"""Every serve option is one entry of the table: a flag (maybe), an LMSERVE_* variable, a default filled into its
help; a flag wins over the variable, the variable over the default; unusable values are refused naming their source."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from lmserve.cli import build_parser
from lmserve.config import OPTIONS, ConfigError, ServerConfig, env_name, environment_help, resolve
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.registry import ENGINES
from lmserve.types import AUTO_CONTEXT


def flags(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(["serve", *argv]))


def serve_help() -> str:
    subparsers = build_parser()._subparsers
    assert subparsers is not None
    action = subparsers._group_actions[0]
    assert isinstance(action, argparse._SubParsersAction)
    return str(action.choices["serve"].format_help())


def test_defaults() -> None:
    config = resolve(flags(), env={})
    assert config == ServerConfig()
    assert (config.host, config.port, config.ctx_size, config.parallel) == ("127.0.0.1", 11434, AUTO_CONTEXT, 4)
    assert (config.n_predict, config.keep_alive) == (-1, 300.0)


@pytest.mark.parametrize(
    ("argv", "env", "field", "expected"),
    [
        (["--port", "9000"], {}, "port", 9000),
        ([], {"LMSERVE_PORT": "9001"}, "port", 9001),
        (["--port", "9000"], {"LMSERVE_PORT": "9001"}, "port", 9000),
        (["-c", "2048"], {}, "ctx_size", 2048),
        ([], {"LMSERVE_CTX_SIZE": "1024"}, "ctx_size", 1024),
        (["-ngl", "99"], {}, "n_gpu_layers", 99),
        ([], {"LMSERVE_N_GPU_LAYERS": "12"}, "n_gpu_layers", 12),
        (["--parallel", "8"], {}, "parallel", 8),
        ([], {"LMSERVE_PARALLEL": "2"}, "parallel", 2),
        (["--threads", "3"], {}, "threads", 3),
        ([], {"LMSERVE_THREADS": "1"}, "threads", 1),
        (["--api-key", "k1"], {"LMSERVE_API_KEY": "k2"}, "api_key", "k1"),
        ([], {"LMSERVE_API_KEY": "k2"}, "api_key", "k2"),
        (["-m", "/models/x.gguf"], {}, "model", "/models/x.gguf"),
        (["-m", "/models/x.gguf", "other"], {}, "model", "/models/x.gguf"),
        (["smollm2:135m"], {"LMSERVE_MODEL": "/m.gguf"}, "model", "smollm2:135m"),
        ([], {"LMSERVE_MODEL": "/m.gguf"}, "model", "/m.gguf"),
        ([], {"LMSERVE_HOST": "0.0.0.0"}, "host", "0.0.0.0"),
        ([], {"LMSERVE_HOST": "0.0.0.0:8080"}, "host", "0.0.0.0"),
        ([], {"LMSERVE_HOST": "0.0.0.0:8080"}, "port", 8080),
        ([], {"LMSERVE_HOST": "[::1]:8080"}, "host", "::1"),
        ([], {"LMSERVE_HOST": "::1"}, "host", "::1"),
        ([], {"LMSERVE_HOST": "http://0.0.0.0:8080"}, "port", 8080),
        (["--host", "0.0.0.0:7001"], {}, "port", 7001),
        (["--port", "7000"], {"LMSERVE_HOST": "0.0.0.0:8080"}, "port", 7000),
        (["-b", "128"], {}, "batch_size", 128),
        ([], {"LMSERVE_PREFILL_CHUNK": "64"}, "prefill_chunk", 64),
        (["-n", "256"], {}, "n_predict", 256),
        (["--n-predict", "-1"], {"LMSERVE_N_PREDICT": "64"}, "n_predict", -1),
        ([], {"LMSERVE_N_PREDICT": "64"}, "n_predict", 64),
        ([], {"LMSERVE_KEEP_ALIVE": "1h30m"}, "keep_alive", 5400.0),
        ([], {"LMSERVE_KEEP_ALIVE": "-1"}, "keep_alive", None),
        ([], {"LMSERVE_KEEP_ALIVE": "90"}, "keep_alive", 90.0),
        (["--image-allow-host", "a", "--image-allow-host", "b,c"], {}, "image_allow_hosts", ("a", "b", "c")),
        ([], {"LMSERVE_IMAGE_ALLOW_HOSTS": "a, b"}, "image_allow_hosts", ("a", "b")),
        ([], {"LMSERVE_MODELS": "/store"}, "models_dir", "/store"),
        # the GPU servers' launch options: their own flags and variables, or aliases of ours that mean the same
        (["--max-model-len", "8192"], {}, "ctx_size", 8192),
        ([], {"LMSERVE_MAX_MODEL_LEN": "2048"}, "ctx_size", 2048),
        ([], {"LMSERVE_CTX_SIZE": "1024", "LMSERVE_MAX_MODEL_LEN": "2048"}, "ctx_size", 1024),
        (["--max-num-seqs", "64"], {}, "parallel", 64),
        ([], {"LMSERVE_MAX_NUM_SEQS": "16"}, "parallel", 16),
        (["--served-model-name", "lfm"], {}, "alias", "lfm"),
        ([], {"LMSERVE_SERVED_MODEL_NAME": "lfm"}, "alias", "lfm"),
        (["--chunked-prefill-size", "-1"], {}, "prefill_chunk", -1),
        ([], {"LMSERVE_CHUNKED_PREFILL_SIZE": "1024"}, "prefill_chunk", 1024),
        (["--model-path", "LiquidAI/LFM2-1.2B"], {}, "model", "LiquidAI/LFM2-1.2B"),
        (["--engine", "vllm"], {}, "engine", "vllm"),
        ([], {"LMSERVE_ENGINE": "llamacpp"}, "engine", "llamacpp"),
        (["--dtype", "float16"], {}, "dtype", "float16"),
        ([], {"LMSERVE_DTYPE": "bfloat16"}, "dtype", "bfloat16"),
        (["--gpu-memory-utilization", "0.85"], {}, "gpu_memory_utilization", 0.85),
        ([], {"LMSERVE_GPU_MEMORY_UTILIZATION": "0.5"}, "gpu_memory_utilization", 0.5),
        (["-tp", "2"], {}, "tensor_parallel_size", 2),
        ([], {"LMSERVE_TENSOR_PARALLEL_SIZE": "8"}, "tensor_parallel_size", 8),
        (["--pipeline-parallel-size", "2"], {}, "pipeline_parallel_size", 2),
        ([], {"LMSERVE_DATA_PARALLEL_SIZE": "2"}, "data_parallel_size", 2),
        (["--enable-torch-compile"], {}, "enable_torch_compile", True),
        ([], {"LMSERVE_ENABLE_TORCH_COMPILE": "true"}, "enable_torch_compile", True),
        ([], {"LMSERVE_ENABLE_TORCH_COMPILE": "0"}, "enable_torch_compile", False),
        ([], {}, "kv_offloading_size", 0.0),
        (["--kv-offloading-size", "16"], {}, "kv_offloading_size", 16.0),
        ([], {"LMSERVE_KV_OFFLOADING_SIZE": "0.5"}, "kv_offloading_size", 0.5),
        (["--kv-offloading-backend", "lmcache"], {}, "kv_offloading_backend", "lmcache"),
        ([], {}, "kv_offloading_backend", "native"),
        ([], {"LMSERVE_TOOL_CALL_PARSER": "lfm2"}, "tool_call_parser", "lfm2"),
    ],
)
def test_flag_then_environment_then_default(argv: list[str], env: dict[str, str], field: str, expected: object) -> None:
    assert resolve(flags(*argv), env=env).value(field) == expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"LMSERVE_PORT": "eleven"}, "LMSERVE_PORT must be an integer, got 'eleven'"),
        (["--port", "99999"], {}, "--port must be at most 65535, got 99999"),
        (["--port", "x"], {}, "--port must be an integer, got 'x'"),
        ([], {"LMSERVE_HOST": "h:99999"}, "LMSERVE_HOST: expected a port number"),
        (["--parallel", "0"], {}, "--parallel must be at least 1, got 0"),
        ([], {"LMSERVE_CTX_SIZE": "-5"}, "LMSERVE_CTX_SIZE must be at least 1, got -5"),
        (["-n", "0"], {}, "--n-predict must be at least 1 (or -1), got 0"),
        ([], {"LMSERVE_KEEP_ALIVE": "soon"}, "LMSERVE_KEEP_ALIVE: expected a duration"),
        (["--image-min-tokens", "64", "--image-max-tokens", "32"], {}, "image-max-tokens (32) is below"),
        (["--draft-p-min", "0.5"], {}, "--draft-p-min applies to a draft model's drafts: give --model-draft too"),
        (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization must be at most 1.0, got 1.5"),
        ([], {"LMSERVE_GPU_MEMORY_UTILIZATION": "most"}, "LMSERVE_GPU_MEMORY_UTILIZATION must be a number"),
        (["--dtype", "int4"], {}, "--dtype must be one of auto, float16, bfloat16, float32, got 'int4'"),
        (["--engine", "ollama"], {}, "--engine must be one of auto, llamacpp, mlx, vllm, got 'ollama'"),
        ([], {"LMSERVE_ENABLE_TORCH_COMPILE": "maybe"}, "LMSERVE_ENABLE_TORCH_COMPILE must be one of 1, true"),
        (["--kv-offloading-size", "-1"], {}, "--kv-offloading-size must be at least 0.0, got -1"),
        ([], {"LMSERVE_KV_OFFLOADING_BACKEND": "disk"}, "LMSERVE_KV_OFFLOADING_BACKEND must be one of native, lmcache"),
        (["--chunked-prefill-size", "0"], {}, "--prefill-chunk must be at least 1 (or -1), got 0"),
        (["-tp", "0"], {}, "--tensor-parallel-size must be at least 1, got 0"),
        (["-ctk", "q3_k"], {}, "--cache-type-k must be one of f32, f16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"),
        ([], {"LMSERVE_FLASH_ATTN": "yes"}, "LMSERVE_FLASH_ATTN must be one of on, off, auto, got 'yes'"),
        (["--replica-routing", "round-robin"], {}, "--replica-routing sets up Ray Serve replicas: give --replicas N"),
        ([], {"LMSERVE_SCALE_WINDOW": "5s"}, "LMSERVE_SCALE_WINDOW sets up Ray Serve replicas"),
    ],
)
def test_unusable_values_are_refused_naming_their_source(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve(flags(*argv), env=env)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("argv", "env", "engine", "message"), [
    (["--dtype", "float16"], {}, "llamacpp", "--dtype is a vLLM option, but"),
    ([], {"LMSERVE_TENSOR_PARALLEL_SIZE": "2"}, "llamacpp", "--tensor-parallel-size is a vLLM option"),
    (["--enable-torch-compile"], {}, "llamacpp", "--enable-torch-compile is a vLLM option"),
    (["-ngl", "99"], {}, "vllm", "--n-gpu-layers is a llama.cpp option, but"),
    (["--mmproj", "/p.gguf"], {}, "vllm", "--mmproj is a llama.cpp option"),
    (["-b", "64"], {}, "vllm", "--batch-size is a llama.cpp option"),
    (["-ctk", "q8_0"], {}, "vllm", "--cache-type-k is a llama.cpp option"),
    ([], {"LMSERVE_FLASH_ATTN": "on"}, "vllm", "--flash-attn is a llama.cpp option"),
    (["--thread-policy", "fixed"], {}, "vllm", "--thread-policy is a llama.cpp option"),
    ([], {"LMSERVE_KV_UNIFIED": "1"}, "vllm", "--kv-unified is a llama.cpp option"),
])
def test_an_option_only_the_other_engine_understands_is_refused(argv: list[str], env: dict[str, str], engine: str,
                                                               message: str) -> None:
    config = resolve(flags("m", *argv), env=env)
    refusal = config.refused_by(engine)
    assert refusal is not None and refusal.startswith(message) and "drop it" in refusal


@pytest.mark.parametrize("argv", [["-c", "2048", "-np", "8", "--chunked-prefill-size", "-1", "-a", "x"], []])
def test_options_both_engines_understand_are_accepted_by_each(argv: list[str]) -> None:
    config = resolve(flags(*argv), env={})
    assert config.refused_by("vllm") is None and config.refused_by("llamacpp") is None


def llama(*argv: str, env: dict[str, str] | None = None) -> LlamaCppLaunch:
    return resolve(flags(*argv), env=env or {}).launch_of(LlamaCppLaunch)


def test_kv_cache_flags_and_variables_reach_the_llama_cpp_launch_options() -> None:
    options = llama("-ctk", "q8_0", "--cache-type-v", "q4_0", "-fa", "on")
    assert (options.cache_type_k, options.cache_type_v, options.flash_attn) == ("q8_0", "q4_0", "on")
    options = llama(env={"LMSERVE_CACHE_TYPE_K": "q5_1", "LMSERVE_FLASH_ATTN": "off"})
    assert (options.cache_type_k, options.cache_type_v, options.flash_attn) == ("q5_1", "f16", "off")


def test_engine_options_that_are_load_options_are_the_servers_defaults_for_them() -> None:
    """-ngl and -b are llama.cpp's flags for the load options num_gpu and num_batch (which requests and Modelfiles
    may set per model); -c, -np and -t are every engine's."""
    options = resolve(flags("-ngl", "7", "-b", "64", "-c", "2048", "-np", "3", "-t", "2"), env={}).load_options
    assert (options.num_gpu_layers, options.num_batch, options.num_ctx, options.num_parallel, options.num_threads) \
        == (7, 64, 2048, 3, 2)


def test_one_shared_kv_pool_is_off_unless_asked() -> None:
    assert llama().kv_unified is False
    assert llama("--kv-unified").kv_unified is True
    assert llama("-kvu").kv_unified is True
    assert llama(env={"LMSERVE_KV_UNIFIED": "yes"}).kv_unified is True


def test_the_thread_policy_is_adaptive_unless_fixed() -> None:
    assert llama().thread_policy == "adaptive"
    assert llama("--thread-policy", "fixed").thread_policy == "fixed"
    assert llama(env={"LMSERVE_THREAD_POLICY": "fixed"}).thread_policy == "fixed"
    with pytest.raises(ConfigError, match="--thread-policy must be one of adaptive, fixed"):
        resolve(flags("--thread-policy", "spin"), env={})


def test_a_draft_model_turns_speculative_decoding_on_unless_draft_max_says_otherwise() -> None:
    assert llama().draft_limit == 0
    options = llama("-md", "small.gguf")
    assert options.draft_limit == 16 and options.model_draft == "small.gguf"
    assert llama("--model-draft", "small.gguf", "--draft-max", "0").draft_limit == 0
    options = llama(env={"LMSERVE_MODEL_DRAFT": "small.gguf", "LMSERVE_DRAFT_MAX": "4", "LMSERVE_DRAFT_P_MIN": "0.5"})
    assert (options.draft_limit, options.draft_p_min) == (4, 0.5)
    assert "--model-draft is a llama.cpp option" in str(resolve(flags("-md", "x"), env={}).refused_by("vllm"))


def test_every_field_is_one_entry_with_its_own_variable() -> None:
    """The server's options, then each engine's (its launch record's fields), each tagged with its engine."""
    engines = [(spec.name, f.name) for spec in ENGINES for f in fields(spec.launch)]
    server = [f.name for f in fields(ServerConfig) if f.name not in ("launch", "given")]
    assert list(OPTIONS) == server + [name for _, name in engines]
    assert all(OPTIONS[name].engine == engine for engine, name in engines)
    assert all(OPTIONS[name].engine is None for name in server)
    variables = [env_name(name) for name in OPTIONS]
    assert len(set(variables)) == len(variables)
    assert all(v.startswith("LMSERVE_") for v in variables)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("PER SEQUENCE", "serve"),
        ("(default -1, unlimited; LMSERVE_N_PREDICT)", "serve"),
        ("(default one per physical core; LMSERVE_THREADS)", "serve"),
        ("-n N, --n-predict N", "serve"),
        ("(default auto; vLLM only; LMSERVE_DTYPE)", "serve"),
        ("(default auto: the largest power of two whose KV cache for all slots fits in 25% of the memory the weights "
         "leave (RAM, or the GPU memory on a GPU), from 4096 to 262144 tokens; LMSERVE_CTX_SIZE, "
         "LMSERVE_MAX_MODEL_LEN)", "serve"),
        ("never more than the model was trained for (a larger N is capped there, with a warning)", "serve"),
        ("HF_TOKEN", "serve"),
        ("LMSERVE_KEEP_ALIVE", "environment"),
        ("(default 5m)", "environment"),
        ("(default ~/.lmserve/models)", "environment"),
    ],
)
def test_help_fills_in_each_default_from_its_value(text: str, where: str) -> None:
    shown = serve_help() if where == "serve" else environment_help()
    assert text in " ".join(shown.split())


def test_flags_and_environment_only_options_are_all_documented() -> None:
    shown = serve_help()
    for entry in OPTIONS.values():
        assert all(name in shown for name in entry.env_names)
        for flag in entry.flags:
            assert flag in shown


@pytest.mark.parametrize(("raw", "seconds"), [("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("-1", None)])
def test_the_keep_alive_variable_is_a_duration(raw: str, seconds: float | None) -> None:
    assert resolve({}, {"LMSERVE_KEEP_ALIVE": raw}).keep_alive == seconds


def test_a_keep_alive_that_is_no_duration_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="LMSERVE_KEEP_ALIVE"):
        resolve({}, {"LMSERVE_KEEP_ALIVE": "later"})


def test_replica_options_go_with_replicas() -> None:
    config = resolve(flags("--replicas", "2", "--replica-routing", "round-robin"), env={"LMSERVE_SCALE_WINDOW": "5s"})
    assert (config.replicas, config.replica_routing, config.scale_window) == (2, "round-robin", 5.0)
    assert resolve(flags("--max-replicas", "3", "--ray-address", "auto"), env={}).ray_address == "auto"
