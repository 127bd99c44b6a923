"""What residency keeps: a loaded model and how it renders prompts, the key of an engine instance's weights, the plan
to load one, the instance, a resident name's lease, a model's health, and keep-alive in seconds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lmserve.engine.factory import MemoryEstimate
from lmserve.engine.protocol import Engine
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions, Message, SamplingParams

MAX_KEEP_ALIVE = 100 * 365 * 24 * 3600.0
"""A longer keep_alive means forever (and keeps expiry dates representable)."""


class Prompter(Protocol):
    """Renders a conversation into the model's prompt text (a Jinja chat template or a Modelfile Go one)."""

    def render(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
        think: bool | str | None = None,
    ) -> str:
        """The prompt text; `think` (None: the model's default) switches thinking on or off, or sets its effort."""
        ...


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: its engine (maybe shared with other names), how it renders prompts, its defaults."""

    name: str
    engine: Engine
    template: Prompter
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """A fixed model's sampling defaults (StaticCatalog); a stored model's come from its Modelfile (the catalog)."""
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    template_source: str | None = None
    """The template text the prompter renders (Modelfile TEMPLATE or the model's), for tool-format detection."""
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()
    owned_by: str = "lmserve"


@dataclass(frozen=True, slots=True)
class WeightsKey:
    """What makes one engine instance: the weights and every load-time option (adapters and projector included)."""

    weights: str
    options: LoadOptions


@dataclass(slots=True)
class LoadPlan:
    """How to serve a name: the instance it needs, how to open one (blocking), and how to bind one to the name."""

    key: WeightsKey
    open: Callable[[], Engine]
    bind: Callable[[Engine], LoadedModel]
    binding: str = ""
    """What the bound settings were made from (e.g. the manifest's digest): a change means binding again."""
    estimate: Callable[[], MemoryEstimate | None] | None = None
    """What an instance will hold in memory (blocking: reads headers, not weights); None: not known."""


Planner = Callable[[str, LoadOptions], LoadPlan]
"""(canonical name, load options) → its LoadPlan; raises ModelNotFound or InvalidRequest."""


@dataclass(slots=True, eq=False)
class Instance:
    """One engine in memory and the requests using it (across every name bound to it)."""

    key: WeightsKey
    engine: Engine
    last_used: float
    users: int = 0
    memory: MemoryEstimate | None = None
    """What it holds in memory, as estimated before it loaded (None: not estimated)."""
    failure: str | None = None
    """Why its engine failed (then it serves nothing more and is closed once its requests are gone)."""
    is_closed: bool = False
    is_asleep: bool = False
    """Its engine freed its KV cache and slots (sleep level 1) and nothing has used it since."""

    @property
    def is_idle(self) -> bool:
        return self.users == 0 and self.engine.num_running == 0 and self.engine.num_waiting == 0

    @property
    def ram_bytes(self) -> int:
        """The RAM it holds by its estimate (0: on a GPU, or not estimated)."""
        if self.memory is None or self.memory.on_gpu:
            return 0
        return self.memory.total + self.engine.stats.adapter_bytes  # adapters loaded per request since


@dataclass(slots=True, eq=False)
class Resident:
    """One resident model name: its bound model, its instance and its lease."""

    model: LoadedModel
    instance: Instance
    binding: str
    keep_alive: float | None
    last_used: float
    users: int = 0
    loaded_at: float = field(default_factory=time.time)

    @property
    def options(self) -> LoadOptions:
        return self.instance.key.options

    @property
    def memory(self) -> MemoryEstimate | None:
        """What its instance holds in memory, as estimated before it loaded (None: not estimated)."""
        return self.instance.memory

    @property
    def expires_at(self) -> float | None:
        return None if self.keep_alive is None else self.last_used + self.keep_alive

    @property
    def is_idle(self) -> bool:
        return self.users == 0


ModelState = Literal["ok", "loading", "restarting", "failed"]


@dataclass(frozen=True, slots=True)
class ModelHealth:
    """Whether a resident (or loading) model can answer now, and why not."""

    name: str
    state: ModelState
    reason: str = ""


def keep_alive_seconds(keep_alive: float) -> float | None:
    """Negative, infinite or beyond a century → forever (None); else seconds. NaN is refused."""
    if math.isnan(keep_alive):
        raise InvalidRequest("keep_alive must be a number of seconds or a duration, not NaN", param="keep_alive")
    if keep_alive < 0 or keep_alive > MAX_KEEP_ALIVE:
        return None
    return keep_alive
