"""Every serve flag has an LMSERVE_* variable; a flag wins over the variable, the variable over the default."""

from __future__ import annotations

import pytest

from lmserve.cli import build_parser
from lmserve.config import ConfigError, ServerConfig, resolve


def flags(*argv: str) -> dict[str, object]:
    args = vars(build_parser().parse_args(["serve", *argv]))
    path = args.pop("model_path")
    if path is not None:
        args["model"] = path
    return args


def test_defaults() -> None:
    config = resolve(flags(), env={})
    assert config == ServerConfig()
    assert (config.host, config.port, config.ctx_size, config.parallel) == ("127.0.0.1", 11434, 4096, 4)


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
        (["smollm2:135m"], {"LMSERVE_MODEL": "/m.gguf"}, "model", "smollm2:135m"),
        ([], {"LMSERVE_MODEL": "/m.gguf"}, "model", "/m.gguf"),
        ([], {"LMSERVE_HOST": "0.0.0.0"}, "host", "0.0.0.0"),
        ([], {"LMSERVE_HOST": "0.0.0.0:8080"}, "port", 8080),
        (["--port", "7000"], {"LMSERVE_HOST": "0.0.0.0:8080"}, "port", 7000),
        (["-b", "128"], {}, "batch_size", 128),
        ([], {"LMSERVE_PREFILL_CHUNK": "64"}, "prefill_chunk", 64),
    ],
)
def test_flag_then_environment_then_default(argv: list[str], env: dict[str, str], field: str, expected: object) -> None:
    assert getattr(resolve(flags(*argv), env=env), field) == expected


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], {"LMSERVE_PORT": "eleven"}),
        (["--parallel", "0"], {}),
        ([], {"LMSERVE_CTX_SIZE": "-5"}),
    ],
)
def test_unusable_values_are_refused(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        resolve(flags(*argv), env=env)


def test_help_says_the_context_is_per_sequence() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert "PER SEQUENCE" in serve.format_help()
