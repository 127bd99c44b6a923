"""Server configuration: every flag and LMSERVE_* environment variable is declared here once, nowhere else.

Each field of `ServerConfig` is one entry of the options table: its default, its flags, its environment variable,
how its text is read, the bounds it must keep, and a help text into which the default is filled from the value
(in the spirit of llama.cpp's `add_opt(...).set_env(...)`). `add_arguments` builds `lmserve serve`'s flags from
the table, so adding an option is adding one field.

Precedence: command-line flag → environment variable → default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, TypeVar

from lmserve.parsing import ParseError, format_duration, parse_address, parse_duration
from lmserve.types import (
    AUTO_CONTEXT,
    AUTO_CONTEXT_CEILING,
    AUTO_CONTEXT_FLOOR,
    AUTO_KV_FRACTION,
    DRAFT_P_MIN,
    FLASH_ATTN_MODES,
    KV_CACHE_TYPES,
    THREAD_POLICIES,
    LoadOptions,
)

ENV_PREFIX = "LMSERVE_"


def _default_cache_ram_mib() -> int:
    """A quarter of the machine's memory, at most 8 GiB (llama-server's --cache-ram default), in MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1024
    return min(8192, total // 4 // 2**20)


DEFAULT_CACHE_RAM_MIB = _default_cache_ram_mib()
T = TypeVar("T")
DRAFT_MODEL_MAX = 16
"""The draft cap with --model-draft when --draft-max is not given: drafts start at 4 tokens and double up to it while
they are accepted whole (engine/drafting.py `DraftLength`)."""
Kind = Literal["str", "int", "float", "bool", "list", "duration"]
EngineName = Literal["llamacpp", "vllm"]


@dataclass(frozen=True, slots=True)
class Option:
    """One server option: how it is given (flags, environment), read (`kind`), checked and described."""

    env: str
    """The environment variable, without the LMSERVE_ prefix."""
    help: str
    flags: tuple[str, ...] = ()
    """`-c`, `--ctx-size` …; none: set through the environment only."""
    kind: Kind = "str"
    """How a text value is read: as is, an integer, a number, a switch (a flag without a value; 1/true/yes/on in
    the environment), a comma-separated list, or a duration (negative: forever)."""
    minimum: float | None = None
    maximum: float | None = None
    special: int | None = None
    """One value allowed outside the bounds (e.g. -1 for "unlimited")."""
    metavar: str | None = None
    shown: str | None = None
    """How the default reads in the help when the value alone says nothing ("all cores")."""
    positional: str | None = None
    """The option is also the positional argument of this name (the model to serve)."""
    choices: tuple[str, ...] = ()
    """The values allowed (none: any)."""
    engine: EngineName | None = None
    """The one engine that understands the option (None: both); given for a model on the other, it is an error."""
    env_aliases: tuple[str, ...] = ()
    """More environment variables (without the prefix) that set it, under the names other servers use."""

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.env

    @property
    def name(self) -> str:
        """What an error message calls the option: its first long flag, else its variable."""
        return next((flag for flag in self.flags if flag.startswith("--")), self.env_name)

    def describe_default(self, default: object) -> str:
        if self.shown is not None:
            return self.shown
        if self.kind == "duration":
            return format_duration(default if isinstance(default, int | float) else None)
        if default is None or default == ():
            return "none"
        return str(default)

    @property
    def env_names(self) -> tuple[str, ...]:
        return (self.env_name, *(ENV_PREFIX + alias for alias in self.env_aliases))

    def help_text(self, default: object) -> str:
        """The help line: the text, then the default (filled in from the value) and the variable(s)."""
        engine = f"{ENGINE_LABELS[self.engine]} only; " if self.engine else ""
        return f"{self.help} (default {self.describe_default(default)}; {engine}{', '.join(self.env_names)})"


ENGINE_LABELS: dict[str, str] = {"llamacpp": "llama.cpp", "vllm": "vLLM"}


def option(default: T, *flags: str, env: str, help: str, kind: Kind = "str", minimum: float | None = None,
           maximum: float | None = None, special: int | None = None, metavar: str | None = None,
           shown: str | None = None, positional: str | None = None, choices: tuple[str, ...] = (),
           engine: EngineName | None = None, env_aliases: tuple[str, ...] = ()) -> T:
    """A ServerConfig field that is also an entry of the options table."""
    entry = Option(env=env, help=help, flags=flags, kind=kind, minimum=minimum, maximum=maximum, special=special,
                   metavar=metavar, shown=shown, positional=positional, choices=choices, engine=engine,
                   env_aliases=env_aliases)
    return field(default=default, metadata={"option": entry})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `lmserve serve` needs to start; each field is one option (flag, variable, default, help)."""

    model: str = option("smollm2:135m", "-m", "--model-path", env="MODEL", positional="model", metavar="PATH",
                        help="a stored model's name, a hub repository <org>/<repo> (pulled when not stored; gated "
                        "ones read the token from HF_TOKEN), a .gguf file, or a directory with config.json and "
                        "safetensors")
    engine: str = option("auto", "--engine", env="ENGINE", choices=("auto", "llamacpp", "vllm"),
                         help="the engine: auto picks llama.cpp for GGUF weights and vLLM for safetensors")
    host: str = option("127.0.0.1", "--host", env="HOST", help="address to listen on (host:port accepted)")
    port: int = option(11434, "--port", env="PORT", kind="int", minimum=1, maximum=65535,
                       help="port to listen on")
    ctx_size: int = option(AUTO_CONTEXT, "-c", "--ctx-size", "--max-model-len", env="CTX_SIZE", kind="int",
                           minimum=1, metavar="N", env_aliases=("MAX_MODEL_LEN",),
                           shown="auto: the largest power of two whose KV cache for all slots "
                           f"fits in {AUTO_KV_FRACTION:.0%} of the memory the weights leave (RAM, or the GPU memory "
                           f"on a GPU), from {AUTO_CONTEXT_FLOOR} to {AUTO_CONTEXT_CEILING} tokens",
                           help="context length PER SEQUENCE in tokens; each of the --parallel slots gets this many; "
                           "never more than the model was trained for (a larger N is capped there, with a warning)")
    n_gpu_layers: int = option(0, "-ngl", "--n-gpu-layers", env="N_GPU_LAYERS", kind="int", minimum=-1, metavar="N",
                               engine="llamacpp",
                               help="layers to offload to a GPU (-1: all)")
    parallel: int = option(4, "-np", "--parallel", "--max-num-seqs", env="PARALLEL", kind="int", minimum=1,
                           metavar="N", env_aliases=("MAX_NUM_SEQS",),
                           help="sequences decoded together")
    threads: int | None = option(None, "-t", "--threads", env="THREADS", kind="int", minimum=1, metavar="N",
                                 shown="all cores", help="CPU threads")
    api_key: str | None = option(None, "--api-key", env="API_KEY", metavar="KEY",
                                 help="require 'Authorization: Key KEY' or 'Bearer KEY' on every route but "
                                 "/health, /livez, / and the web page's /web/ files")
    batch_size: int = option(512, "-b", "--batch-size", env="BATCH_SIZE", kind="int", minimum=1, metavar="N",
                             engine="llamacpp",
                             help="most tokens decoded in one step")
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
    dtype: str = option("auto", "--dtype", env="DTYPE", choices=("auto", "float16", "bfloat16", "float32"),
                        engine="vllm", help="weight and activation dtype (a hybrid model's convolution state "
                        "follows it)")
    gpu_memory_utilization: float | None = option(None, "--gpu-memory-utilization", env="GPU_MEMORY_UTILIZATION",
                                                  kind="float", minimum=0.0, maximum=1.0, metavar="F",
                                                  engine="vllm", shown="vLLM's 0.9 on a GPU",
                                                  help="fraction of GPU memory for weights and KV cache, 0-1 (GPU "
                                                  "only: vLLM's CPU build sizes its KV cache for --parallel x "
                                                  "--ctx-size)")
    tensor_parallel_size: int = option(1, "-tp", "--tensor-parallel-size", env="TENSOR_PARALLEL_SIZE", kind="int",
                                       minimum=1, metavar="N", engine="vllm",
                                       help="GPUs (or CPU workers) each layer is split over")
    pipeline_parallel_size: int = option(1, "-pp", "--pipeline-parallel-size", env="PIPELINE_PARALLEL_SIZE",
                                         kind="int", minimum=1, metavar="N", engine="vllm",
                                         help="stages the layers are split into")
    data_parallel_size: int = option(1, "-dp", "--data-parallel-size", env="DATA_PARALLEL_SIZE", kind="int",
                                     minimum=1, metavar="N", engine="vllm", help="replicas of the model")
    nnodes: int = option(1, "--nnodes", env="NNODES", kind="int", minimum=1, metavar="N", engine="vllm",
                         help="machines one model spans (vLLM's multiprocessing multi-node: start the same command "
                         "on each, with its --node-rank)")
    node_rank: int = option(0, "--node-rank", env="NODE_RANK", kind="int", minimum=0, metavar="R", engine="vllm",
                            help="this machine's rank among --nnodes; rank 0 serves HTTP, the others run --headless")
    master_addr: str = option("127.0.0.1", "--master-addr", env="MASTER_ADDR", metavar="ADDR", engine="vllm",
                              help="the address of node rank 0, which the other nodes join")
    master_port: int = option(29501, "--master-port", env="MASTER_PORT", kind="int", minimum=1, maximum=65535,
                              metavar="PORT", engine="vllm", help="the port node rank 0 is joined on")
    distributed_executor_backend: str = option("auto", "--distributed-executor-backend", choices=("auto", "mp", "ray"),
                                               env="DISTRIBUTED_EXECUTOR_BACKEND", engine="vllm",
                                               help="how vLLM runs its workers: mp (processes, and --nnodes over "
                                               "machines) or ray (a Ray cluster's GPUs; start Ray first)")
    headless: bool = option(False, "--headless", env="HEADLESS", kind="bool", engine="vllm",
                            help="run this node's vLLM workers only (no HTTP); it ends when node rank 0 does")
    enable_torch_compile: bool = option(False, "--enable-torch-compile", env="ENABLE_TORCH_COMPILE", kind="bool",
                                        engine="vllm", help="compile the model (and capture CUDA graphs): longer "
                                        "start, faster tokens; off runs eagerly")
    kv_offloading_size: float = option(0.0, "--kv-offloading-size", env="KV_OFFLOADING_SIZE", kind="float",
                                       minimum=0.0, metavar="GIB", engine="vllm", shown="0, off",
                                       help="GiB of CPU RAM that KV blocks leaving the GPU's KV cache go to, so a "
                                       "returning prompt's prefix is copied back instead of prefilled (GPU only: "
                                       "vLLM's CPU build keeps its KV cache in RAM already)")
    kv_offloading_backend: str = option("native", "--kv-offloading-backend", env="KV_OFFLOADING_BACKEND",
                                        choices=("native", "lmcache"), engine="vllm",
                                        help="who keeps the offloaded KV blocks (with --kv-offloading-size): native "
                                        "(vLLM's CPU offloading) or lmcache (an LMCache server, which sizes its own "
                                        "RAM and disk tiers)")
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
    cache_type_k: str = option("f16", "-ctk", "--cache-type-k", env="CACHE_TYPE_K", choices=KV_CACHE_TYPES,
                               metavar="TYPE", engine="llamacpp",
                               help="KV cache type of the keys: f16, or quantized to save memory (q8_0 about half, "
                               "q4_0 about a quarter)")
    cache_type_v: str = option("f16", "-ctv", "--cache-type-v", env="CACHE_TYPE_V", choices=KV_CACHE_TYPES,
                               metavar="TYPE", engine="llamacpp",
                               help="KV cache type of the values (a quantized type needs flash attention)")
    flash_attn: str = option("auto", "-fa", "--flash-attn", env="FLASH_ATTN", choices=FLASH_ATTN_MODES,
                             engine="llamacpp",
                             help="flash attention: on, off, or auto (where llama.cpp's backend has it)")
    kv_unified: bool = option(False, "-kvu", "--kv-unified", env="KV_UNIFIED", kind="bool", engine="llamacpp",
                              help="one KV pool of --ctx-size tokens shared by all --parallel slots, each growing "
                              "up to all of it, instead of --ctx-size tokens reserved per slot; when the pool is "
                              "full, idle slots' prefix caches go first, then the newest sequences pause and are "
                              "recomputed later (their output unchanged)")
    thread_policy: str = option("adaptive", "--thread-policy", env="THREAD_POLICY", choices=THREAD_POLICIES,
                                engine="llamacpp",
                                help="adaptive: compute with the cores other programs leave free (at most "
                                "--threads), so a busy machine does not stall every step; fixed: always --threads")
    draft_max: int = option(0, "--draft-max", env="DRAFT_MAX", kind="int", minimum=0, maximum=64,
                            metavar="N", engine="llamacpp", shown=f"0, off; {DRAFT_MODEL_MAX} with --model-draft",
                            help="speculative decoding: draft up to N tokens per step from the sequence's own "
                            "context (prompt lookup) or the draft model, and keep what the model agrees with; the "
                            "output is unchanged (a request's draft_max overrides it)")
    model_draft: str | None = option(None, "-md", "--model-draft", env="MODEL_DRAFT", metavar="PATH",
                                     engine="llamacpp",
                                     help="speculative decoding with a small GGUF of the same vocabulary (e.g. a "
                                     "smaller model of the family) drafting for each served GGUF model")
    draft_p_min: float = option(DRAFT_P_MIN, "--draft-p-min", env="DRAFT_P_MIN", kind="float", minimum=0.0,
                                maximum=1.0, metavar="P", engine="llamacpp",
                                shown="0, no floor",
                                help="the draft model's draft stops before a token it gives less probability than P")
    cache_ram: int = option(DEFAULT_CACHE_RAM_MIB, "-cram", "--cache-ram", env="CACHE_RAM", kind="int", minimum=0,
                            metavar="MiB", engine="llamacpp", shown=f"{DEFAULT_CACHE_RAM_MIB}: a quarter of this "
                            "machine's memory, at most 8192",
                            help="RAM for the prompt cache beyond the slots, all models together: a slot's state "
                            "is saved there before another prompt takes the slot, and a returning prompt restores "
                            "it instead of computing its prefix again; least recently used out first (0: off)")
    cache_disk: int = option(4096, "--cache-disk", env="CACHE_DISK", kind="int", minimum=0, metavar="MiB",
                             engine="llamacpp",
                             help="disk for the prompt cache, under the model store (prompt-cache/): the states "
                             "saved in RAM are also written there, so a conversation returning after a restart or "
                             "a reload skips its prefill; least recently used out first (0: off)")
    slot_prompt_similarity: float = option(0.5, "-sps", "--slot-prompt-similarity", env="SLOT_PROMPT_SIMILARITY",
                                           kind="float", minimum=0.0, maximum=1.0, metavar="F", engine="llamacpp",
                                           help="a prompt takes the free slot sharing its longest prefix only when "
                                           "that prefix is at least F of the slot's cached tokens; otherwise an "
                                           "empty slot, else the least recently used (its state saved first)")
    max_images: int = option(16, env="MAX_IMAGES", kind="int", minimum=1, help="most images one request may carry")
    mmproj: str | None = option(None, "--mmproj", env="MMPROJ", metavar="PATH", engine="llamacpp",
                                help="vision projector GGUF for a model given as a .gguf path")
    image_min_tokens: int = option(0, "--image-min-tokens", env="IMAGE_MIN_TOKENS", kind="int", minimum=0,
                                   metavar="N", shown="the projector's", engine="llamacpp",
                                   help="fewest tokens per image or tile")
    image_max_tokens: int = option(0, "--image-max-tokens", env="IMAGE_MAX_TOKENS", kind="int", minimum=0,
                                   metavar="N", shown="the projector's", engine="llamacpp",
                                   help="most tokens per image or tile")
    image_allow_hosts: tuple[str, ...] = option((), "--image-allow-host", env="IMAGE_ALLOW_HOSTS", kind="list",
                                                metavar="HOST",
                                                help="let image URLs reach HOST (name, IP or host:port) even when it "
                                                "is private or loopback; repeatable, or comma-separated")
    image_max_bytes: int = option(20 * 1024 * 1024, env="IMAGE_MAX_BYTES", kind="int", minimum=1,
                                  help="largest image accepted, in bytes (data URI, base64 or download)")
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
    load_timeout: float | None = option(300.0, env="LOAD_TIMEOUT", kind="duration",
                                        help="how long a model may take to load before its request fails with an "
                                        "error (a hung engine start); negative: no limit")
    given: frozenset[str] = field(default=frozenset())
    """The options set by a flag or a variable (not defaulted): those one engine does not understand are refused."""

    def refused_by(self, engine: EngineName) -> str | None:
        """Why this configuration cannot serve a model on `engine` (an option only the other engine understands
        was given), or None."""
        for name in sorted(self.given):
            entry = OPTIONS.get(name)
            if entry is not None and entry.engine is not None and entry.engine != engine:
                return (f"{entry.name} is a {ENGINE_LABELS[entry.engine]} option, but {self.model} is served by "
                        f"{ENGINE_LABELS[engine]}; drop it" + (" or pass --engine llamacpp with a .gguf model"
                                                                 if engine == "vllm" else
                                                                 " or serve a safetensors repository (--engine vllm)"))
        return None

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
            cache_type_k=self.cache_type_k,
            cache_type_v=self.cache_type_v,
            flash_attn=self.flash_attn,
            kv_unified=self.kv_unified,
            thread_policy=self.thread_policy,
            draft_model=self.model_draft,
            draft_p_min=self.draft_p_min,
        )

    @property
    def speculative_draft_max(self) -> int:
        """The draft cap for requests that do not set their own: --draft-max, else DRAFT_MODEL_MAX with a draft
        model (a draft model means speculative decoding), else 0 (off)."""
        if "draft_max" in self.given or self.model_draft is None:
            return self.draft_max
        return DRAFT_MODEL_MAX


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(ServerConfig) if "option" in f.metadata}
"""The options table: ServerConfig field name → its entry."""
DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(ServerConfig) if f.name in OPTIONS}

DEFAULT_ORIGINS: tuple[str, ...] = (
    *(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
      for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)
"""Origins CORS always allows, as the local runner does: local pages on any port, and desktop-app webviews."""


class ConfigError(ValueError):
    """A flag or environment variable has a value lmserve cannot use."""


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
    low, high = values.get("image_min_tokens"), values.get("image_max_tokens")
    if isinstance(low, int) and isinstance(high, int) and 0 < high < low:
        raise ConfigError(f"image-max-tokens ({high}) is below image-min-tokens ({low})")
    if "draft_p_min" in values and not values.get("model_draft"):
        raise ConfigError(f"{sources['draft_p_min']} applies to a draft model's drafts: give --model-draft too")
    return ServerConfig(**values, given=frozenset(values))  # type: ignore[arg-type]


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


def _check(entry: Option, value: object, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value == entry.special:
        return
    also = f" (or {entry.special})" if entry.special is not None else ""
    if entry.minimum is not None and value < entry.minimum:
        raise ConfigError(f"{source} must be at least {entry.minimum}{also}, got {value}")
    if entry.maximum is not None and value > entry.maximum:
        raise ConfigError(f"{source} must be at most {entry.maximum}, got {value}")
