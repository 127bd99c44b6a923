"""Server configuration: every flag and LMSERVE_* environment variable, in one table.

Each field of `ServerConfig` is one entry of the options table (option_table.py): its default, its flags, its
environment variable, how its text is read, the bounds it must keep, and a help text into which the default is
filled from the value. Each engine declares its own options the same way, as the fields of its launch record
(engine/<name>/options.py); `OPTIONS` gathers the server's and every engine's (engine/registry.py), `add_arguments`
builds `lmserve serve`'s flags from it, and a given option of another engine than the model's is refused
(`refused_by`). Adding an option is adding one field.

Precedence: command-line flag → environment variable → default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from lmserve.engine.registry import AUTO, ENGINES
from lmserve.option_table import ConfigError as ConfigError  # re-exported: the CLI catches it
from lmserve.option_table import Option, entries, option
from lmserve.parsing import ParseError, parse_address, parse_duration
from lmserve.types import (
    AUTO_CONTEXT,
    AUTO_CONTEXT_CEILING,
    AUTO_CONTEXT_FLOOR,
    AUTO_KV_FRACTION,
    VERIFY_MODES,
    LoadOptions,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `lmserve serve` needs to start; each field is one option (flag, variable, default, help)."""

    model: str = option("smollm2:135m", "-m", "--model", "--model-path", env="MODEL", positional="model",
                        metavar="PATH",
                        help="a stored model's name, a hub repository <org>/<repo> (pulled when not stored; gated "
                        "ones read the token from HF_TOKEN), a .gguf file, or a directory with config.json and "
                        "safetensors")
    engine: str = option(AUTO, "--engine", env="ENGINE", choices=(AUTO, *(spec.name for spec in ENGINES)),
                         help="the engine: auto picks by the model's kind ("
                         + "; ".join(f"{spec.label} for {spec.serves}" for spec in ENGINES) + ")")
    host: str = option("127.0.0.1", "--host", env="HOST", help="address to listen on (host:port accepted)")
    port: int = option(11434, "--port", env="PORT", kind="int", minimum=1, maximum=65535,
                       help="port to listen on")
    ctx_size: int = option(AUTO_CONTEXT, "-c", "--ctx-size", "--max-model-len", env="CTX_SIZE", kind="int",
                           minimum=1, metavar="N", env_aliases=("MAX_MODEL_LEN",), load="num_ctx",
                           shown="auto: the largest power of two whose KV cache for all slots "
                           f"fits in {AUTO_KV_FRACTION:.0%} of the memory the weights leave (RAM, or the GPU memory "
                           f"on a GPU), from {AUTO_CONTEXT_FLOOR} to {AUTO_CONTEXT_CEILING} tokens",
                           help="context length PER SEQUENCE in tokens; each of the --parallel slots gets this many; "
                           "never more than the model was trained for (a larger N is capped there, with a warning)")
    parallel: int = option(4, "-np", "--parallel", "--max-num-seqs", env="PARALLEL", kind="int", minimum=1,
                           metavar="N", env_aliases=("MAX_NUM_SEQS",), load="num_parallel",
                           help="sequences decoded together")
    threads: int | None = option(None, "-t", "--threads", env="THREADS", kind="int", minimum=1, metavar="N",
                                 shown="one per physical core", load="num_threads", help="CPU threads")
    api_key: str | None = option(None, "--api-key", env="API_KEY", metavar="KEY",
                                 help="require 'Authorization: Key KEY' or 'Bearer KEY' on every route but "
                                 "/health, /livez, / and the web page's /web/ files")
    otlp_traces_endpoint: str | None = option(
        None, "--otlp-traces-endpoint", env="OTLP_TRACES_ENDPOINT", metavar="URL",
        shown="off (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT when set)",
        help="export an OpenTelemetry trace of each request to this OTLP collector (http://host:4318: /v1/traces is "
        "added to a URL without a path)")
    verify_signatures: str = option("warn", "--verify-signatures", env="VERIFY_SIGNATURES", choices=VERIFY_MODES,
                                    help="check a model's signature (OpenSSF model signing) as it enters the store: "
                                    "off; warn: verify one that comes with it, log a failure; require: refuse a model "
                                    "without a signature that verifies")
    signature_key: str | None = option(None, "--signature-key", env="SIGNATURE_KEY", metavar="PEM",
                                       help="the public key (elliptic curve, PEM) model signatures verify against")
    signature_certificates: tuple[str, ...] = option(
        (), "--signature-certificate", env="SIGNATURE_CERTIFICATES", kind="list", metavar="PEM",
        help="the certificate chain (PEM files) a signing certificate must chain to; repeatable")
    prefill_chunk: int | None = option(None, "--prefill-chunk", "--chunked-prefill-size", env="PREFILL_CHUNK",
                                       kind="int", minimum=1, special=-1, metavar="N",
                                       env_aliases=("CHUNKED_PREFILL_SIZE",),
                                       shown="256 on llama.cpp, vLLM's own on vLLM",
                                       help="most prompt tokens prefilled in one step, so running streams keep "
                                       "going; -1 prefills a prompt whole (no chunking)")
    n_predict: int = option(-1, "-n", "--n-predict", env="N_PREDICT", kind="int", minimum=1, special=-1,
                            metavar="N", shown="-1, unlimited",
                            help="most tokens a reply may have when the request and the Modelfile say nothing")
    alias: str | None = option(None, "-a", "--alias", "--served-model-name", env="ALIAS", metavar="NAME",
                               env_aliases=("SERVED_MODEL_NAME",), help="name the model answers to")
    models_dir: str = option("~/.lmserve/models", env="MODELS", help="the model store (blobs and manifests)")
    keep_alive: float | None = option(300.0, env="KEEP_ALIVE", kind="duration",
                                      help="how long a model stays loaded after its last request")
    max_loaded_models: int = option(3, env="MAX_LOADED_MODELS", kind="int", minimum=1,
                                    help="most models loaded at once")
    memory_check: bool = option(True, env="MEMORY_CHECK", kind="bool", shown="1, on",
                                help="before a model loads, check that its weights, KV cache and buffers fit in "
                                "memory: idle models are unloaded for it, and one that can never fit is a 400 naming "
                                "the numbers (0: load without checking, where /proc/meminfo misleads)")
    memory_bytes: int | None = option(None, env="MEMORY_BYTES", kind="int", minimum=1,
                                      shown="what the machine has available, read at each load",
                                      help="bytes all loaded models may take together, when the machine's own "
                                      "numbers do not tell this server's share (containers, tests)")
    tool_call_parser: str | None = option(None, "--tool-call-parser", env="TOOL_CALL_PARSER", metavar="NAME",
                                          shown="detect from the chat template, else json",
                                          help="tool-call format: lfm2, hermes, llama3_json, pythonic, json")
    reasoning_parser: str | None = option(None, "--reasoning-parser", env="REASONING_PARSER", metavar="NAME",
                                          shown="detect from the chat template",
                                          choices=("qwen3", "deepseek_r1", "mistral", "kimi", "command", "seed_oss"),
                                          help="how the model marks its thinking, kept apart from the answer")
    reasoning_budget: int | None = option(None, "--reasoning-budget", env="REASONING_BUDGET", kind="int", minimum=0,
                                          metavar="N", shown="unlimited",
                                          help="most thinking tokens of a reply; then the thinking is closed and "
                                          "the answer follows (a request's reasoning_budget overrides it)")
    max_queue: int = option(512, env="MAX_QUEUE", kind="int", minimum=0,
                            help="requests that may wait for a slot, per model; beyond it 503 with Retry-After")
    shutdown_grace: int = option(10, env="SHUTDOWN_GRACE", kind="int", minimum=0,
                                 help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    hf_endpoint: str | None = option(None, env="HF_ENDPOINT", shown="HF_ENDPOINT, else huggingface.co",
                                     help="the Hugging Face hub `pull` downloads from")
    origins: tuple[str, ...] = option((), env="ORIGINS", kind="list",
                                      help="browser origins CORS allows besides the local ones, comma-separated "
                                      "(`*` matches anything; `http://host:*` any port)")
    max_body_bytes: int = option(64 * 1024 * 1024, env="MAX_BODY", kind="int", minimum=1,
                                 help="largest request body in bytes (413 beyond it); blob uploads are exempt")
    max_messages: int = option(1024, env="MAX_MESSAGES", kind="int", minimum=1,
                               help="most messages one chat request may carry")
    max_images: int = option(16, env="MAX_IMAGES", kind="int", minimum=1, help="most images one request may carry")
    loras: tuple[str, ...] = option((), "--lora", "--lora-modules", env="LORA", kind="list", metavar="NAME=PATH",
                                    help="serve the LoRA adapter at PATH (a GGUF LoRA over a GGUF, a PEFT directory "
                                    "over a repository) over the served model as the model NAME, sharing its loaded "
                                    "weights; repeatable, or comma-separated")
    enable_lora: bool = option(False, "--enable-lora", env="ENABLE_LORA", kind="bool",
                               help="load vLLM models ready for LoRA adapters per request (vLLM's flag; implied by "
                               "--lora and --runtime-lora; llama.cpp and MLX need no preparing)")
    max_loras: int = option(8, "--max-loras", env="MAX_LORAS", kind="int", minimum=1, metavar="N",
                            help="LoRA adapters kept loaded per model at once (the least recently used idle one "
                            "goes first)")
    max_lora_rank: int = option(64, "--max-lora-rank", env="MAX_LORA_RANK", kind="int", minimum=1, metavar="N",
                                help="highest LoRA rank accepted; an adapter of a higher rank is a 400")
    runtime_lora: bool = option(False, "--runtime-lora", env="RUNTIME_LORA", kind="bool",
                                help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime "
                                "LoRA routes) while serving")
    image_allow_hosts: tuple[str, ...] = option((), "--image-allow-host", env="IMAGE_ALLOW_HOSTS", kind="list",
                                                metavar="HOST",
                                                help="let image URLs reach HOST (name, IP or host:port) even when it "
                                                "is private or loopback; repeatable, or comma-separated")
    image_max_bytes: int = option(20 * 1024 * 1024, env="IMAGE_MAX_BYTES", kind="int", minimum=1,
                                  help="largest image accepted, in bytes (data URI, base64 or download)")
    audio_max_seconds: float = option(600.0, "--audio-max-seconds", env="AUDIO_MAX_SECONDS", kind="float",
                                      minimum=1, metavar="SECONDS",
                                      help="longest audio clip accepted (chat input_audio, transcriptions); a longer "
                                      "one is a 400")
    responses_max: int = option(1000, env="RESPONSES_MAX", kind="int", minimum=1,
                                help="most stored /v1/responses kept on disk (the oldest go first), and "
                                "most /v1/conversations")
    responses_ttl: float | None = option(30 * 86400.0, env="RESPONSES_TTL", kind="duration",
                                         help="how long a stored /v1/responses response is kept (negative: forever)")
    completions_max: int = option(1000, env="COMPLETIONS_MAX", kind="int", minimum=1,
                                  help="most stored chat completions (`store: true`) kept on disk (the oldest go "
                                  "first)")
    completions_ttl: float | None = option(30 * 86400.0, env="COMPLETIONS_TTL", kind="duration",
                                           help="how long a stored chat completion is kept (negative: forever)")
    files_max_upload: int = option(512 * 1024 * 1024, "--files-max-upload", env="FILES_MAX_UPLOAD", kind="int",
                                   minimum=1, metavar="BYTES",
                                   help="largest file one POST /v1/files upload may carry, in bytes (413 beyond "
                                   "it; LMSERVE_MAX_BODY does not bound uploads)")
    files_max_count: int = option(10000, "--files-max-count", env="FILES_MAX_COUNT", kind="int", minimum=1,
                                  metavar="N", help="most files (/v1/files) kept on disk (the oldest go first; those "
                                  "an unfinished batch reads stay)")
    files_max_bytes: int = option(20 * 1024 * 1024 * 1024, "--files-max-bytes", env="FILES_MAX_BYTES", kind="int",
                                  minimum=1, metavar="BYTES",
                                  help="most bytes all files (/v1/files) may take on disk together (the oldest go "
                                  "first; those an unfinished batch reads stay)")
    files_ttl: float | None = option(30 * 86400.0, "--files-ttl", env="FILES_TTL", kind="duration",
                                     metavar="DURATION",
                                     help="how long a file (/v1/files) is kept (negative: until deleted)")
    batch_concurrency: int = option(32, "--batch-concurrency", env="BATCH_CONCURRENCY", kind="int", minimum=1,
                                    maximum=4096, metavar="N",
                                    help="most lines of one batch (/v1/batches, `lmserve batch`) in flight at once; "
                                    "they run at the lowest priority, after interactive requests")
    load_timeout: float | None = option(300.0, env="LOAD_TIMEOUT", kind="duration",
                                        help="how long a model may take to load before its request fails with an "
                                        "error (a hung engine start); negative: no limit")
    sleep_idle_seconds: float | None = option(None, "--sleep-idle-seconds", env="SLEEP_IDLE_SECONDS",
                                              kind="duration", metavar="DURATION", shown="never",
                                              help="put a model to sleep after it has been unused this long: its "
                                              "engine closes (memory freed, its room in the memory budget kept) and "
                                              "its next request loads it again (POST /sleep?level=2)")
    supervisor: bool = option(True, env="SUPERVISOR", kind="bool", shown="1, on",
                              help="run the server under a small supervisor process that keeps the port and starts "
                              "the server again when a signal ends it (a native crash of llama.cpp, the kernel's "
                              "out-of-memory killer); 0: one process, for platforms that restart it themselves")
    replicas: int | None = option(None, "--replicas", env="REPLICAS", kind="int", minimum=1, metavar="N",
                                  shown="none: one server, no Ray",
                                  help="serve through Ray Serve with N replicas of the model behind one endpoint, "
                                  "each conversation routed to the replica holding its prompt cache")
    min_replicas: int | None = option(None, "--min-replicas", env="MIN_REPLICAS", kind="int", minimum=0,
                                      metavar="N", shown="none",
                                      help="autoscale on Ray Serve: fewest replicas (with --max-replicas)")
    max_replicas: int | None = option(None, "--max-replicas", env="MAX_REPLICAS", kind="int", minimum=1,
                                      metavar="N", shown="none",
                                      help="autoscale on Ray Serve: most replicas; one is added when the requests "
                                      "in flight exceed --parallel per replica")
    ray_address: str | None = option(None, "--ray-address", env="RAY_ADDRESS", metavar="ADDR",
                                     shown="none: a Ray started for this server on this machine",
                                     help="the Ray cluster the replicas run on (ray://host:10001, or host:6379 from "
                                     "a cluster node; auto: the cluster this node belongs to)")
    replica_routing: str = option("prefix", "--replica-routing", env="REPLICA_ROUTING",
                                  choices=("prefix", "least-loaded", "round-robin"),
                                  help="how Ray Serve picks a replica: prefix (the one that served the longest "
                                  "start of this prompt, the less loaded when none did), least-loaded (Ray's "
                                  "power of two choices), round-robin")
    replica_cpus: float = option(1.0, "--replica-cpus", env="REPLICA_CPUS", kind="float", minimum=0,
                                 metavar="N", help="CPUs Ray reserves for each replica")
    replica_gpus: float = option(0.0, "--replica-gpus", env="REPLICA_GPUS", kind="float", minimum=0,
                                 metavar="N", help="GPUs Ray reserves for each replica (the vLLM engine on a GPU: "
                                 "its --tensor-parallel-size)")
    replica_stream_interval: int = option(50, "--replica-stream-interval", env="REPLICA_STREAM_INTERVAL", kind="int",
                                          minimum=0, metavar="MS",
                                          help="a replica sends a stream's pieces on at most once per MS "
                                          "milliseconds (the first at once; those that come sooner go together), "
                                          "as Ray Serve LLM batches streams; 0: each piece as it comes")
    scale_window: float | None = option(30.0, env="SCALE_WINDOW", kind="duration",
                                        help="how far back Ray Serve averages the requests in flight per replica "
                                        "when it decides to add or remove one")
    scale_up_delay: float | None = option(30.0, env="SCALE_UP_DELAY", kind="duration",
                                          help="how long the load must stay above target before Ray Serve adds "
                                          "a replica")
    scale_down_delay: float | None = option(600.0, env="SCALE_DOWN_DELAY", kind="duration",
                                            help="how long the load must stay below target before Ray Serve "
                                            "removes a replica")
    launch: tuple[Any, ...] = field(default_factory=lambda: tuple(spec.launch() for spec in ENGINES))
    """Each engine's launch record (its options), in the order of engine/registry.py `ENGINES`."""
    given: frozenset[str] = field(default=frozenset())
    """The options set by a flag or a variable (not defaulted): those one engine does not understand are refused."""

    def value(self, name: str) -> Any:
        """The value of option `name`, the server's or an engine's."""
        owner = OPTIONS[name].engine
        if owner is None:
            return getattr(self, name)
        return getattr(self.launch[ENGINE_INDEX[owner]], name)

    def launch_of(self, kind: type[T]) -> T:
        """The launch record of this type (an engine's options)."""
        return next(record for record in self.launch if isinstance(record, kind))

    def refused_by(self, engine: str) -> str | None:
        """Why this configuration cannot serve a model on `engine` (an option only another engine understands was
        given), or None."""
        spec = ENGINES[ENGINE_INDEX[engine]]
        for name in sorted(self.given):
            entry = OPTIONS.get(name)
            if entry is not None and entry.engine is not None and entry.engine != engine:
                owner = ENGINES[ENGINE_INDEX[entry.engine]]
                return (f"{entry.name} is a {owner.label} option, but {self.model} is served by {spec.label}; drop "
                        f"it, or serve one of the {owner.serves} that {owner.label} serves")
        return None

    @property
    def load_options(self) -> LoadOptions:
        """The server's defaults of the per-model load options (the options that name a `load` field)."""
        return LoadOptions(**{entry.load: self.value(name) for name, entry in OPTIONS.items() if entry.load})


def _table() -> tuple[dict[str, Option], dict[str, object]]:
    """The options of the server and of every engine (names are unique across them), and their defaults."""
    table = {name: entry for name, (entry, _) in entries(ServerConfig).items()}
    defaults = {name: default for name, (_, default) in entries(ServerConfig).items()}
    for spec in ENGINES:
        for name, (entry, default) in entries(spec.launch).items():
            assert name not in table, f"option {name} is declared twice"
            table[name] = replace(entry, engine=spec.name, engine_label=spec.label)
            defaults[name] = default
    return table, defaults


OPTIONS, DEFAULTS = _table()
"""The options table: field name → its entry (an engine's options carry its name), and the defaults."""
ENGINE_INDEX: dict[str, int] = {spec.name: index for index, spec in enumerate(ENGINES)}

DEFAULT_ORIGINS: tuple[str, ...] = (
    *(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
      for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)
"""Origins CORS always allows, as the local runner does: local pages on any port, and desktop-app webviews."""


def env_name(name: str) -> str:
    """The environment variable of a ServerConfig field."""
    return OPTIONS[name].env_name


def flag_dest(name: str) -> str:
    """Where argparse puts a flag's value: the field name, or `<field>_flag` beside a positional of that name."""
    return f"{name}_flag" if OPTIONS[name].positional else name


# ---- the command line ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option that has flags to `parser` (values stay text: `resolve` reads and checks them)."""
    for name, entry in OPTIONS.items():
        help_text = entry.help_text(DEFAULTS[name]).replace("%", "%%")
        if entry.positional:
            parser.add_argument(entry.positional, nargs="?", metavar=entry.positional.upper(), help=help_text)
        if entry.flags and entry.kind == "bool":
            parser.add_argument(*entry.flags, dest=flag_dest(name), action="store_const", const=True,
                                help=help_text)
        elif entry.flags:
            action = "append" if entry.kind == "list" else "store"
            parser.add_argument(*entry.flags, dest=flag_dest(name), action=action, metavar=entry.metavar,
                                help=help_text)


def environment_help() -> str:
    """The options set through the environment only, one per line with their defaults (for an epilog)."""
    lines = ["environment only:"]
    for name, entry in OPTIONS.items():
        if not entry.flags:
            lines.append(f"  {entry.env_name:<28} {entry.help} (default {entry.describe_default(DEFAULTS[name])})")
    return "\n".join(lines)


# ---- resolving -----------------------------------------------------------------------------------------------------


def resolve(flags: Mapping[str, object | None], env: Mapping[str, str] | None = None) -> ServerConfig:
    """Build a ServerConfig from parsed flags (None = not given; text is read as the option's kind) and the
    environment. Raises ConfigError naming the flag or variable whose value is unusable."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for name, entry in OPTIONS.items():
        value = flags.get(flag_dest(name))
        if value is None and entry.positional:
            value = flags.get(name)
        source = entry.name
        if value is None:
            found = next(((var, env[var]) for var in entry.env_names if env.get(var)), None)
            if found is None:
                continue
            source, value = found
        values[name], sources[name] = _read(entry, value, source), source
    _split_host(values, sources)
    for name, value in values.items():
        _check(OPTIONS[name], value, sources[name])
    _check_replicas(values, sources)
    launch = []
    for spec in ENGINES:
        own = {name: values.pop(name) for name in entries(spec.launch) if name in values}
        check = getattr(spec.launch, "check", None)
        if check is not None:
            check(own, sources)
        launch.append(spec.launch(**own))
    return ServerConfig(**values, launch=tuple(launch), given=frozenset(sources))  # type: ignore[arg-type]


def _read(entry: Option, value: object, source: str) -> object:
    if entry.kind == "list":
        items = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
        return tuple(part.strip() for item in items for part in str(item).split(",") if part.strip())
    if not isinstance(value, str):
        return value
    if entry.kind == "duration":
        try:
            seconds = parse_duration(value)
        except ParseError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return None if seconds < 0 else seconds
    if entry.kind == "int":
        try:
            return int(value.strip())
        except ValueError:
            raise ConfigError(f"{source} must be an integer, got {value!r}") from None
    if entry.kind == "float":
        try:
            return float(value.strip())
        except ValueError:
            raise ConfigError(f"{source} must be a number, got {value!r}") from None
    if entry.kind == "bool":
        if value.strip().lower() not in _SWITCH:
            raise ConfigError(f"{source} must be one of {', '.join(_SWITCH)}, got {value!r}")
        return _SWITCH[value.strip().lower()]
    if entry.choices and value not in entry.choices:
        raise ConfigError(f"{source} must be one of {', '.join(entry.choices)}, got {value!r}")
    return value


_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _split_host(values: dict[str, object], sources: dict[str, str]) -> None:
    """`host:port` in the host (LMSERVE_HOST=0.0.0.0:8080, as the local runner accepts) sets the port too,
    unless --port was given."""
    host = values.get("host")
    if not isinstance(host, str):
        return
    try:
        address = parse_address(host)
    except ParseError as exc:
        raise ConfigError(f"{sources['host']}: {exc}") from None
    values["host"] = address.host or DEFAULTS["host"]
    if address.port is not None and sources.get("port") != OPTIONS["port"].name:
        values["port"], sources["port"] = address.port, sources["host"]


REPLICA_OPTIONS = ("ray_address", "replica_routing", "replica_cpus", "replica_gpus", "replica_stream_interval",
                   "scale_window", "scale_up_delay", "scale_down_delay")
"""Options of the Ray Serve replicas only: refused when the server runs alone, where nothing would honour them."""


def _check_replicas(values: Mapping[str, object], sources: Mapping[str, str]) -> None:
    if any(values.get(name) is not None for name in ("replicas", "min_replicas", "max_replicas")):
        return
    stray = [sources[name] for name in REPLICA_OPTIONS if name in sources]
    if stray:
        raise ConfigError(f"{stray[0]} sets up Ray Serve replicas: give --replicas N, or --min-replicas/--max-replicas "
                          "to autoscale, or drop it")


def _check(entry: Option, value: object, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value == entry.special:
        return
    also = f" (or {entry.special})" if entry.special is not None else ""
    if entry.minimum is not None and value < entry.minimum:
        raise ConfigError(f"{source} must be at least {entry.minimum}{also}, got {value}")
    if entry.maximum is not None and value > entry.maximum:
        raise ConfigError(f"{source} must be at most {entry.maximum}, got {value}")
