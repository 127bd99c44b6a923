"""What an engine is to the rest of lmserve: its `EngineSpec` (engine/registry.py holds the table of them) and the
server-wide `EngineSettings` every engine opens models with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lmserve.engine.sampling_support import SAMPLING_OPTIONS
from lmserve.types import LoadOptions

if TYPE_CHECKING:
    from lmserve.engine.memory_estimate import HeaderReader, MemoryEstimate
    from lmserve.engine.protocol import Engine
    from lmserve.engine.slots.prompt_cache import PromptCache

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Server-wide engine settings that are not per-model load options."""

    engine: str = "auto"
    """`auto` (the first engine in the table that claims the model) or an engine's name."""
    max_prefill_tokens: int | None = None
    """Most prompt tokens prefilled in one step (chunked prefill); -1: whole prompts; None: the engine's default."""
    max_queue: int = 512
    """Requests that may wait for a slot; beyond it Overloaded (503)."""
    prompt_cache: PromptCache | None = None
    """Saved prompt states beyond the slots, shared by every model of the slot engine (None: each engine keeps a
    small one)."""
    max_loras: int = 8
    """LoRA adapters kept loaded per model at once (--max-loras)."""
    max_lora_rank: int = 64
    """The highest LoRA rank accepted (--max-lora-rank)."""
    enable_lora: bool = False
    """Engines that must be readied for adapters when they load (vLLM) are (--enable-lora, --lora, --runtime-lora)."""
    launch: tuple[object, ...] = ()
    """Each engine's launch record (its options as the server was started with them)."""

    def of(self, kind: type[T]) -> T:
        """The launch record of this type (its defaults when the server was not given one)."""
        return next((record for record in self.launch if isinstance(record, kind)), None) or kind()


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine as the table knows it. Its functions import the engine's runtime when called, never before."""

    name: str
    """What `--engine` and ModelInfo.engine call it ("llamacpp")."""
    label: str
    """What people call it ("llama.cpp")."""
    serves: str
    """The models it claims, in words ("GGUF files")."""
    launch: type
    """Its launch record: a dataclass whose fields are options (option_table.py `option`)."""
    claims: Callable[[Path], bool]
    """Whether the model at a path is of the kind it serves (by format; nothing loaded)."""
    open: Callable[[Path, LoadOptions, EngineSettings], Engine]
    """Load the model at a path. Blocking (seconds); InvalidRequest (param "model") when it cannot serve it here."""
    estimate: Callable[[Path, LoadOptions, EngineSettings, HeaderReader], MemoryEstimate | None]
    """What loading the model will hold in memory, from headers alone; None when it cannot be told."""
    missing: Callable[[], str | None] = lambda: None
    """What this machine lacks to run it (its package, its platform), or None: `auto` passes over such an engine
    when another claims the model too."""
    in_process: bool = False
    """It runs models in the server's own process, so a native crash of it ends the process (the supervisor,
    lmserve/supervisor.py, starts it again); False: in processes of its own (vLLM's engine core)."""
    takes: frozenset[str] = frozenset()
    """What a Modelfile may add to a model it serves: "adapters", "projector", "quantize"."""
    adapters_per_request: bool = False
    """It applies LoRA adapters per request (SamplingParams.adapters) over one loaded base: a model made with ADAPTER
    shares its base's engine. False: adapters are load options (an instance of their own), or refused."""
    sampling: frozenset[str] = SAMPLING_OPTIONS
    """The per-request sampling options it honours, by the options table's names; a request that sets another to
    anything but its neutral value is refused, naming it (engine/sampling_support.py)."""
    vision_missing: Callable[[dict[str, Any]], str | None] | None = None
    """What this machine lacks to serve the images of a repository whose config.json this is (None: nothing)."""
    serve_headless: Callable[[Path, LoadOptions, EngineSettings], None] | None = None
    """Run this machine's share of a model that spans several (no HTTP), where the engine can."""
