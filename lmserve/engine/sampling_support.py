"""Which sampling options an engine honours, and the one refusal of the others.

Each engine's `SPEC` (engine/spec.py) names the per-request sampling options it honours (`EngineSpec.sampling`,
by the names of the options table, lmserve/options.py). A request that sets an option its engine does not honour to
anything but the option's neutral value (the value that asks for nothing: top_k 0, typical_p 1, mirostat 0 ...) is
refused here, before it reaches the engine, with a 400 naming the option and the engine. An option without a
neutral value (temperature, seed, stop, num_predict, priority, repeat_last_n) is one every engine honours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmserve.errors import InvalidRequest
from lmserve.options import TABLE
from lmserve.types import SamplingParams

if TYPE_CHECKING:
    from lmserve.engine.spec import EngineSpec

SAMPLING_OPTIONS: frozenset[str] = frozenset(
    name for name, option in TABLE.items() if option.lifetime == "sampling" and option.field is not None
) - {"draft_num_predict"}
"""Every per-request sampling option lmserve uses, by the options table's names (lmserve/options.py; its
draft_num_predict is draft_max by another name)."""


@dataclass(frozen=True, slots=True)
class Neutral:
    """How a request leaves an option alone, for an engine that does not honour it."""

    asks: Callable[[SamplingParams], bool]
    """Whether the request's value asks for something (is not neutral)."""
    what: str
    """What the option does, as a refusal says the engine has none of it ("Mirostat sampling")."""
    leave: str
    """How to leave it alone ("leave mirostat at 0")."""


NEUTRAL: dict[str, Neutral] = {
    "mirostat": Neutral(lambda s: s.mirostat != 0, "Mirostat sampling", "leave mirostat at 0"),
    "mirostat_tau": Neutral(lambda s: s.mirostat != 0, "Mirostat sampling (mirostat_tau tunes it)",
                            "leave mirostat at 0"),
    "mirostat_eta": Neutral(lambda s: s.mirostat != 0, "Mirostat sampling (mirostat_eta tunes it)",
                            "leave mirostat at 0"),
    "typical_p": Neutral(lambda s: s.typical_p < 1.0, "locally typical sampling", "leave typical_p at 1"),
    "draft_max": Neutral(lambda s: bool(s.draft_max), "per-request speculative decoding (draft_max)",
                         "leave draft_max at 0"),
    "top_k": Neutral(lambda s: s.top_k > 0, "top-k sampling", "leave top_k at 0"),
    "top_p": Neutral(lambda s: s.top_p < 1.0, "nucleus sampling (top_p)", "leave top_p at 1"),
    "min_p": Neutral(lambda s: s.min_p > 0.0, "min-p sampling", "leave min_p at 0"),
    "repeat_penalty": Neutral(lambda s: s.repeat_penalty > 0 and s.repeat_penalty != 1.0, "repetition penalty",
                              "leave repeat_penalty at 1"),
    "presence_penalty": Neutral(lambda s: s.presence_penalty != 0.0, "presence penalty",
                                "leave presence_penalty at 0"),
    "frequency_penalty": Neutral(lambda s: s.frequency_penalty != 0.0, "frequency penalty",
                                 "leave frequency_penalty at 0"),
    "logit_bias": Neutral(lambda s: bool(s.logit_bias), "logit bias", "leave logit_bias out"),
    "ignore_eos": Neutral(lambda s: s.ignore_eos, "ignore_eos", "leave ignore_eos false"),
}
"""The options an engine may leave out, in the order they are checked (mirostat before what tunes it)."""


def refuse_unhonoured(sampling: SamplingParams, spec: EngineSpec) -> None:
    """InvalidRequest (param: the option) when `sampling` asks for an option the engine `spec` does not honour."""
    for name, neutral in NEUTRAL.items():
        if name not in spec.sampling and neutral.asks(sampling):
            raise InvalidRequest(f"the {spec.label} engine has no {neutral.what}; {neutral.leave}", param=name)
