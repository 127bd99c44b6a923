"""Server configuration: every flag and LMSERVE_* environment variable is resolved here, nowhere else.

Precedence: command-line flag → environment variable → default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from lmserve.types import LoadOptions


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `lmserve serve` needs to start."""

    model: str = "smollm2:135m"
    """A model name, or a path to a .gguf file."""
    host: str = "127.0.0.1"
    port: int = 11434
    ctx_size: int = 4096
    """Context length per sequence, in tokens."""
    n_gpu_layers: int = 0
    parallel: int = 4
    threads: int | None = None
    api_key: str | None = None
    batch_size: int = 512
    prefill_chunk: int = 256
    alias: str | None = None
    models_dir: str = "~/.lmserve/models"
    """The model store (blobs and manifests)."""
    keep_alive: float | None = 300.0
    """Seconds a model stays loaded after its last request (None: forever)."""
    max_loaded_models: int = 3
    tool_call_parser: str | None = None
    """Tool-call format to parse (lfm2, hermes, llama3_json, pythonic); None: detect from the chat template."""
    max_queue: int = 512
    """Requests that may wait for a slot, per model; beyond it 503 with Retry-After."""
    shutdown_grace: int = 10
    """Seconds in-flight requests get to finish after SIGTERM/SIGINT; the rest then end with an error."""
    hf_endpoint: str | None = None
    """The Hugging Face hub `pull` downloads from (None: HF_ENDPOINT, else huggingface.co)."""
    origins: tuple[str, ...] = ()
    """Browser origins allowed by CORS, on top of DEFAULT_ORIGINS (LMSERVE_ORIGINS, comma-separated).

    A `*` matches anything; after a colon at the end (`http://host:*`) it matches a port number only.
    A lone `*` allows every origin.
    """
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body in bytes (413 beyond it); blob uploads (/api/blobs/…) are exempt."""
    max_messages: int = 1024
    """Most messages one chat request may carry."""
    snapshot_mb: int = 256
    """Memory for prompt-end state snapshots of hybrid models (LFM2), per loaded model, in MiB; 0 turns them off."""
    max_images: int = 16
    """Most images one request may carry."""
    mmproj: str | None = None
    """Vision projector (mmproj) GGUF for a model given as a .gguf path."""
    image_min_tokens: int = 0
    """Fewest tokens per image (or tile); 0: the projector's default."""
    image_max_tokens: int = 0
    """Most tokens per image (or tile); 0: the projector's default."""
    image_allow_hosts: tuple[str, ...] = ()
    """Hosts (name, IP or host:port) image URLs may reach even when private or loopback (comma-separated)."""
    image_max_bytes: int = 20 * 1024 * 1024
    """Largest image accepted, in bytes (data URI, base64 or download)."""

    @property
    def load_options(self) -> LoadOptions:
        return LoadOptions(
            num_ctx=self.ctx_size,
            num_parallel=self.parallel,
            num_gpu_layers=self.n_gpu_layers,
            num_threads=self.threads,
            num_batch=self.batch_size,
            image_min_tokens=self.image_min_tokens,
            image_max_tokens=self.image_max_tokens,
        )


ENV_PREFIX = "LMSERVE_"
_ENV_NAMES = {
    "model": "MODEL",
    "host": "HOST",
    "port": "PORT",
    "ctx_size": "CTX_SIZE",
    "n_gpu_layers": "N_GPU_LAYERS",
    "parallel": "PARALLEL",
    "threads": "THREADS",
    "api_key": "API_KEY",
    "batch_size": "BATCH_SIZE",
    "prefill_chunk": "PREFILL_CHUNK",
    "alias": "ALIAS",
    "models_dir": "MODELS",
    "keep_alive": "KEEP_ALIVE",
    "max_loaded_models": "MAX_LOADED_MODELS",
    "tool_call_parser": "TOOL_CALL_PARSER",
    "max_queue": "MAX_QUEUE",
    "shutdown_grace": "SHUTDOWN_GRACE",
    "hf_endpoint": "HF_ENDPOINT",
    "origins": "ORIGINS",
    "max_body_bytes": "MAX_BODY",
    "max_messages": "MAX_MESSAGES",
    "snapshot_mb": "SNAPSHOT_MB",
    "max_images": "MAX_IMAGES",
    "mmproj": "MMPROJ",
    "image_min_tokens": "IMAGE_MIN_TOKENS",
    "image_max_tokens": "IMAGE_MAX_TOKENS",
    "image_allow_hosts": "IMAGE_ALLOW_HOSTS",
    "image_max_bytes": "IMAGE_MAX_BYTES",
}
_INTS = {"port", "ctx_size", "n_gpu_layers", "parallel", "threads", "batch_size", "prefill_chunk", "max_loaded_models",
         "max_queue", "max_body_bytes", "max_messages", "shutdown_grace", "image_min_tokens", "image_max_tokens",
         "image_max_bytes", "max_images", "snapshot_mb"}
_POSITIVE = {"port", "ctx_size", "parallel", "batch_size", "prefill_chunk", "max_body_bytes", "max_messages",
             "image_max_bytes", "max_images"}
_LISTS = {"origins", "image_allow_hosts"}

DEFAULT_ORIGINS: tuple[str, ...] = (
    *(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
      for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)
"""Origins CORS always allows, as the local runner does: local pages on any port, and desktop-app webviews."""


class ConfigError(ValueError):
    """A flag or environment variable has a value lmserve cannot use."""


def env_name(field: str) -> str:
    return ENV_PREFIX + _ENV_NAMES[field]


def resolve(flags: Mapping[str, object | None], env: Mapping[str, str] | None = None) -> ServerConfig:
    """Build a ServerConfig from parsed flags (None = not given) and the environment."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for f in fields(ServerConfig):
        value = flags.get(f.name)
        if value is None:
            raw = env.get(env_name(f.name))
            if raw is None or raw == "":
                continue
            value = _parse(f.name, raw)
        values[f.name] = value
    host = values.get("host")
    if isinstance(host, str) and ":" in host and not host.startswith("["):
        name, _, port = host.rpartition(":")  # LMSERVE_HOST=0.0.0.0:8080, as the local runner accepts
        values["host"] = name
        if "port" not in values or flags.get("port") is None:
            values["port"] = _parse("port", port)
    for name in _POSITIVE:
        value = values.get(name)
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("image_min_tokens", "image_max_tokens", "snapshot_mb"):
        value = values.get(name)
        if isinstance(value, int) and value < 0:
            raise ConfigError(f"{name.replace('_', '-')} must not be negative, got {value}")
    low, high = values.get("image_min_tokens"), values.get("image_max_tokens")
    if isinstance(low, int) and isinstance(high, int) and 0 < high < low:
        raise ConfigError(f"image-max-tokens ({high}) is below image-min-tokens ({low})")
    return ServerConfig(**values)  # type: ignore[arg-type]


def parse_duration(raw: str) -> float | None:
    """Seconds from '300', '5m', '1h', '30s'; negative means forever (None)."""
    text = raw.strip()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise ConfigError(f"{env_name('keep_alive')} must be a duration like 5m or a number of seconds") from None
    return None if seconds < 0 else seconds


def _parse(field: str, raw: str) -> object:
    if field == "keep_alive":
        return parse_duration(raw)
    if field in _LISTS:
        return tuple(o.strip() for o in raw.split(",") if o.strip())
    if field in _INTS:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{env_name(field)} must be an integer, got {raw!r}") from None
    return raw
