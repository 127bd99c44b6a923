"""One table of the per-request and per-model options: their names, lifetimes, types, ranges and the fields they set.

Every option a request or a Modelfile can give is an entry of `TABLE`: its native name (the key of a native
request's `options` and the Modelfile PARAMETER name), its OpenAI body names, whether it is fixed when a model
loads ("load": a `LoadOptions` field, a change means another engine instance) or read per request ("sampling": a
`SamplingParams` field), its value type and range. An entry without a field is refused with a 400 that names it
and says why; a name that is no entry is refused as unknown. Nothing is dropped in silence.

Values come in layers, each holding only what it sets (`Layer`: option name → field value). Precedence is
written once, in `sampling` and `load_options`, the first layer winning:

    request (OpenAI body or native `options`) → Modelfile PARAMETER → model defaults → server defaults
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from lmserve.errors import InvalidRequest
from lmserve.types import PRIORITY_RANGE, LoadOptions, SamplingParams

Layer = dict[str, Any]
"""What one layer sets: option name → the value of its SamplingParams / LoadOptions field."""
Dialect = Literal["openai", "native"]
Lifetime = Literal["sampling", "load"]
ParameterValue = int | float | bool | str


@dataclass(frozen=True, slots=True)
class Option:
    """One option. `field` is the SamplingParams / LoadOptions field it sets; None when lmserve refuses it."""

    name: str
    kind: type
    lifetime: Lifetime
    field: str | None
    help: str
    low: float | None = None
    high: float | None = None
    above_low: bool = False
    """The value must be greater than `low` (not equal)."""
    openai: tuple[str, ...] = ()
    """The OpenAI body fields that set it, first one winning (an OpenAI-only option has no native name)."""
    native: bool = True
    """Whether native `options` and Modelfile PARAMETERs take it."""
    neutral: tuple[Any, ...] = ()
    """Values of a refused option that ask for nothing lmserve does not do anyway, so they are accepted."""
    ignored: bool = False
    """A refused option taken (its type checked) and ignored whatever its value, because honouring it would change
    nothing a user can observe (`help` says why); the local runner's clients send it."""


def _sampling(name: str, kind: type, help: str, field: str | None = None, **more: Any) -> Option:
    return Option(name, kind, "sampling", field or name, help, **more)


def _load(name: str, kind: type, help: str, field: str | None = None, **more: Any) -> Option:
    return Option(name, kind, "load", field or name, help, **more)


def _refused(name: str, kind: type, why: str, lifetime: Lifetime = "sampling", **more: Any) -> Option:
    return Option(name, kind, lifetime, None, why, **more)


def _ignored(name: str, kind: type, why: str, lifetime: Lifetime = "sampling") -> Option:
    return Option(name, kind, lifetime, None, why, ignored=True)


_NEVER_SHIFTS = ("ignored: lmserve never shifts the context (a prompt that does not fit is refused, a reply ends "
                 "where the context does), so no token is ever dropped and there is nothing to keep")
TABLE: dict[str, Option] = {o.name: o for o in (
    _sampling("temperature", float, "0: greedy (deterministic)", low=0, openai=("temperature",)),
    _sampling("top_k", int, "keep the k likeliest tokens; 0 or less: off", openai=("top_k",)),
    _sampling("top_p", float, "nucleus sampling; 1: off", low=0, above_low=True, high=1, openai=("top_p",)),
    _sampling("min_p", float, "drop tokens below min_p x the likeliest; 0: off", low=0, high=1, openai=("min_p",)),
    _sampling("typical_p", float, "locally typical sampling; 1: off", low=0, above_low=True, high=1,
              openai=("typical_p",)),
    _sampling("repeat_penalty", float, "penalty of recent tokens; 1: off", low=0, above_low=True,
              openai=("repeat_penalty", "repetition_penalty")),
    _sampling("repeat_last_n", int, "how many recent tokens are penalized; -1: the context, 0: off", low=-1),
    _sampling("presence_penalty", float, "penalty of tokens already present", openai=("presence_penalty",)),
    _sampling("frequency_penalty", float, "penalty by how often a token appeared", openai=("frequency_penalty",)),
    _sampling("mirostat", int, "Mirostat sampling: 0 off, 1 or 2 its version", low=0, high=2),
    _sampling("mirostat_tau", float, "Mirostat's target surprise", low=0),
    _sampling("mirostat_eta", float, "Mirostat's learning rate", low=0),
    _sampling("seed", int, "random seed; the same seed and request sample the same reply", openai=("seed",)),
    _sampling("stop", str, "stop sequences (the Modelfile repeats PARAMETER stop)", openai=("stop",)),
    _sampling("num_predict", int, "most tokens to generate; -1: until the context is full", "max_tokens",
              openai=("max_completion_tokens", "max_tokens")),
    _sampling("logit_bias", dict, "token id → bias added to its logit, -100 to 100", openai=("logit_bias",),
              native=False),
    _sampling("ignore_eos", bool, "keep generating past the end-of-generation token", openai=("ignore_eos",),
              native=False),
    _sampling("draft_max", int, "speculative decoding: most tokens drafted (from the context or the draft model) per "
              "step, the output unchanged; 0: off (default: the server's --draft-max)", low=0, high=64,
              openai=("draft_max",)),
    _sampling("draft_num_predict", int, "the local runner's name of draft_max (its clients, llm-ollama's among them, "
              "send it)", "draft_max", low=0, high=64),
    _sampling("priority", int, "scheduling priority: lower runs first and may take a slot from higher (vLLM's "
              "convention); 0 by default, batch lines run at the lowest, 1000", low=PRIORITY_RANGE[0],
              high=PRIORITY_RANGE[1], openai=("priority",)),
    _load("num_ctx", int, "context tokens per sequence", low=1),
    _load("num_batch", int, "most tokens decoded in one step", low=1, high=8192),
    _load("num_gpu", int, "layers offloaded to a GPU; -1: all", "num_gpu_layers", low=-1),
    _load("main_gpu", int, "the GPU that holds the model when it is not split", low=0),
    _load("use_mmap", bool, "map the weights file instead of reading it"),
    _load("use_mlock", bool, "lock the weights in memory (no swapping)"),
    _load("num_thread", int, "CPU threads; 0: all cores", "num_threads", low=0, high=1024),
    _ignored("num_keep", int, _NEVER_SHIFTS),
    _refused("tfs_z", float, "tail-free sampling was removed from llama.cpp; use min_p", neutral=(1, 1.0)),
    _refused("penalize_newline", bool, "llama.cpp no longer penalizes newlines apart", neutral=(False,)),
    _refused("numa", bool, "NUMA placement is not supported (it would change where memory lives)", "load",
             neutral=(False,)),
    _ignored("low_vram", bool, "ignored: llama.cpp removed its low-VRAM mode, so it changes nothing on any engine",
             "load"),
    _refused("f16_kv", bool, "the KV cache's type is the server's --cache-type-k/-v, not a request's (false would ask "
             "for float32 keys and values)", "load", neutral=(True,)),
    _ignored("logits_all", bool, "ignored: it made llama.cpp keep every position's logits, which no reply of the "
             "native routes shows (prompt log-probabilities are computed when a request asks for them)", "load"),
    _refused("vocab_only", bool, "a vocabulary-only model cannot generate", "load", neutral=(False,)),
    _refused("n", int, "several choices (n > 1) are for /v1/chat/completions and /v1/completions", openai=("n",),
             native=False, neutral=(1,)),
    _refused("best_of", int, "only one completion per request is supported (best_of=1)", openai=("best_of",),
             native=False, neutral=(1,)),
)}  # fmt: skip
"""Every option, by native name (an OpenAI-only option by its OpenAI name)."""

NATIVE_DEFAULTS: Layer = {
    "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.1,
    "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}  # fmt: skip
"""The local runner's documented defaults (its DefaultOptions), for the native routes where nothing else is set."""

MODEL_DEFAULT_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature", "general.sampling.top_k": "top_k", "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p", "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n", "general.sampling.mirostat": "mirostat",
    "general.sampling.mirostat_tau": "mirostat_tau", "general.sampling.mirostat_eta": "mirostat_eta",
}  # fmt: skip
"""GGUF metadata keys of a model's recommended sampling (as llama.cpp names them) → option name."""

GENERATION_CONFIG_KEYS: dict[str, str] = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
}  # fmt: skip
"""generation_config.json keys of a Hugging Face repository's recommended sampling → option name."""

PARAMETERS: dict[str, Option] = {name: o for name, o in TABLE.items() if o.native}
"""Every name a Modelfile PARAMETER and native `options` take (the refused ones are refused with a 400)."""

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_BOOLS = {"true": True, "t": True, "1": True, "false": False, "f": False, "0": False}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}


# ---- reading each source into a layer -------------------------------------------------------------------------


def from_native(options: Mapping[str, Any] | None) -> Layer:
    """A native request's `options` as a layer; an unknown, refused or bad option is a 400 naming it."""
    layer: Layer = {}
    for name, value in (options or {}).items():
        if value is None:
            continue
        option = PARAMETERS.get(name)
        if option is None and name in TABLE:
            raise InvalidRequest(f"option '{name}' is taken on the OpenAI routes (/v1) only", param=name)
        if option is None:
            raise InvalidRequest(f"unknown option '{name}'; known: {', '.join(_honoured())}", param=name)
        if _accepted(option, value, name):
            layer[name] = check(option, value, name)
    return layer


def from_openai(body: Mapping[str, Any]) -> Layer:
    """An OpenAI body's sampling fields (those it set, and extra fields that name an option) as a layer.

    Load-time options are refused: /v1 requests run with the model's load options (a Modelfile can set them).
    """
    layer: Layer = {}
    for option in TABLE.values():
        names = option.openai + ((option.name,) if option.native and option.name not in option.openai else ())
        given = [(field, body[field]) for field in names if body.get(field) is not None]
        if not given:
            continue
        field, value = given[0]
        if option.lifetime == "load":
            raise InvalidRequest(f"'{field}' is a load-time option, not taken on /v1: set it with a Modelfile "
                                 "PARAMETER or the native API's options", param=field)
        if _accepted(option, value, field):
            layer[option.name] = check(option, value, field)
    return layer


def parse_parameter(name: str, text: str) -> ParameterValue:
    """A Modelfile PARAMETER's text typed by its name; an unknown, refused or bad one is a 400 naming it."""
    option = PARAMETERS.get(name)
    if option is None:
        raise InvalidRequest(f"unknown parameter '{name}'; known: {', '.join(_honoured())}", param=name)
    if not text:
        raise InvalidRequest(f"parameter '{name}' needs a value", param=name)
    value: ParameterValue | None = None
    if option.kind is bool:
        value = _BOOLS.get(text.lower())
    elif option.kind is int and _INT.fullmatch(text):
        value = int(text)
    elif option.kind is float and _FLOAT.fullmatch(text):
        value = float(text)
    elif option.kind is str:
        value = text
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidRequest(f"parameter '{name}' needs {option.kind.__name__} value, got {text!r}", param=name)
    if _accepted(option, value, name):
        check(option, value, name)
    return value


def parameter_from_json(name: str, value: Any) -> ParameterValue | list[str]:
    """A PARAMETER given as JSON (/api/create `parameters`), typed and checked as `parse_parameter` does text."""
    option = PARAMETERS.get(name)
    if option is None:
        raise InvalidRequest(f"unknown parameter '{name}'; known: {', '.join(_honoured())}", param=name)
    if name == "stop":
        return _stops(value, name)
    if isinstance(value, list):
        raise InvalidRequest(f"parameter '{name}' takes one value, not a list", param=name)
    typed: ParameterValue = _typed(option, value, name)
    if _accepted(option, typed, name):
        check(option, typed, name)
    return typed


def from_parameters(parameters: Mapping[str, Any]) -> Layer:
    """A model's stored Modelfile PARAMETERs (typed, `stop` a list) as a layer."""
    layer: Layer = {}
    for name, value in parameters.items():
        option = PARAMETERS.get(name)
        try:
            if option is None:
                raise InvalidRequest(f"'{name}' is unknown", param=name)
            if _accepted(option, value, name):
                layer[name] = check(option, value, name)
        except InvalidRequest as exc:  # stored by an older lmserve: the model, not the request, must change
            raise InvalidRequest(f"the model's Modelfile has PARAMETER {name}, which lmserve does not take "
                                 f"({exc.message}); create the model again without it", param=name) from None
    return layer


def model_defaults(metadata: Mapping[str, Any], keys: Mapping[str, str] = MODEL_DEFAULT_KEYS) -> Layer:
    """The model's own recommended sampling (GGUF `general.sampling.*`, or with `keys=GENERATION_CONFIG_KEYS` a
    repository's generation_config.json); values that do not check are skipped."""
    layer: Layer = {}
    for key, name in keys.items():
        if key not in metadata:
            continue
        option, value = TABLE[name], metadata[key]
        try:
            if isinstance(value, str):
                value = option.kind(float(value)) if option.kind is int else option.kind(value)
            layer[name] = check(option, value, name)
        except (InvalidRequest, ValueError, OverflowError):
            continue  # untrusted metadata: a value out of range recommends nothing
    return layer


def server_defaults(dialect: Dialect, n_predict: int = -1) -> Layer:
    """The server's layer for a dialect: the local runner's defaults on the native routes (OpenAI routes keep
    SamplingParams' own), and `--n-predict` (-1: unlimited) as the default length limit."""
    layer = dict(NATIVE_DEFAULTS) if dialect == "native" else {}
    if n_predict >= 0:
        layer["num_predict"] = n_predict
    return layer


def layer_of(params: SamplingParams) -> Layer:
    """The fields of `params` that differ from SamplingParams' defaults, as a layer (a fixed model's defaults)."""
    default = SamplingParams()
    layer: Layer = {}
    fields: set[str] = set()
    for option in TABLE.values():
        if option.lifetime == "sampling" and option.field is not None and option.field not in fields:
            fields.add(option.field)
            value = getattr(params, option.field)
            if value != getattr(default, option.field):
                layer[option.name] = _copy(value)
    return layer


# ---- precedence: the first layer wins -------------------------------------------------------------------------


def sampling(*layers: Layer, base: SamplingParams | None = None) -> SamplingParams:
    """`base` (SamplingParams' defaults) with the sampling options of `layers` over it, the first layer winning."""
    base = base or SamplingParams()
    merged = {str(TABLE[name].field): _copy(value) for name, value in _merged(layers, "sampling").items()}
    return replace(base, **{"stop": list(base.stop), "logit_bias": dict(base.logit_bias), **merged})


def load_options(base: LoadOptions, *layers: Layer) -> LoadOptions:
    """`base` (the server's load options) with the load-time options of `layers` over it, the first winning."""
    return replace(base, **{str(TABLE[name].field): value for name, value in _merged(layers, "load").items()})


def json_schema() -> dict[str, Any]:
    """The JSON schema of native `options`: one property per option, with its type, range and help."""
    kinds = {int: "integer", float: "number", bool: "boolean", str: "string"}
    properties: dict[str, Any] = {}
    for name, option in PARAMETERS.items():
        prop: dict[str, Any] = {"type": kinds[option.kind], "description": option.help}
        if name == "stop":
            prop = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                    "description": option.help}
        if option.low is not None:
            prop["exclusiveMinimum" if option.above_low else "minimum"] = option.low
        if option.high is not None:
            prop["maximum"] = option.high
        if option.field is None and not option.ignored:
            prop["description"] = f"refused: {option.help}"
        properties[name] = prop
    return {"type": "object", "properties": properties, "additionalProperties": False}


# ---- checks ---------------------------------------------------------------------------------------------------


def check(option: Option, value: Any, where: str) -> Any:
    """The field value of an option's value: its type and range checked, negative num_predict → None (unlimited),
    top_k below 0 → 0, num_thread 0 → None (all cores), stop → a list, logit_bias keys → token ids."""
    if option.name == "stop":
        return _stops(value, where)
    if option.name == "logit_bias":
        return _logit_bias(value, where)
    value = _typed(option, value, where)
    if isinstance(value, int | float) and not isinstance(value, bool):
        _in_range(option, value, where)
    if option.name == "num_predict":
        return None if value < 0 else value
    if option.name == "top_k":
        return max(value, 0)
    if option.name == "num_thread":
        return value or None
    return value


def _accepted(option: Option, value: Any, where: str) -> bool:
    """True for an option lmserve honours; a refused one is a 400, unless its value is neutral or the option is
    ignored (then False, an ignored one's type checked)."""
    if option.field is not None:
        return True
    if option.ignored:
        _typed(option, value, where)
        return False
    if any(value == n and type(value) is type(n) for n in option.neutral):
        return False
    raise InvalidRequest(f"'{where}' is not supported: {option.help}", param=where)


def _typed(option: Option, value: Any, where: str) -> Any:
    kind = option.kind
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)
    elif kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    elif kind is bool and isinstance(value, bool):
        return value
    raise InvalidRequest(f"'{where}' must be {_TYPE_NAMES[kind]}, got {value!r}", param=where)


def _in_range(option: Option, value: float, where: str) -> None:
    low, high = option.low, option.high
    if low is not None and (value <= low if option.above_low else value < low):
        raise InvalidRequest(f"'{where}' must be {'above' if option.above_low else 'at least'} {low}, got {value}",
                             param=where)
    if high is not None and value > high:
        raise InvalidRequest(f"'{where}' must be at most {high}, got {value}", param=where)


def _stops(value: Any, where: str) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest(f"'{where}' must be a non-empty string or a list of them", param=where)
    return list(stops)


def _logit_bias(value: Any, where: str) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"'{where}' must be an object of token id → bias", param=where)
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else None
        if token is None:
            raise InvalidRequest(f"{where} keys must be token ids, got {key!r}", param=where)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
            raise InvalidRequest(f"{where}[{key!r}] = {bias} is out of range", param=where)
        out[token] = float(bias)
    return out


def _merged(layers: tuple[Layer, ...], lifetime: Lifetime) -> Layer:
    merged: Layer = {}
    for layer in layers:
        for name, value in layer.items():
            if TABLE[name].lifetime == lifetime:
                merged.setdefault(name, value)
    return merged


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value


def _honoured() -> list[str]:
    return [name for name, option in PARAMETERS.items() if option.field is not None]
