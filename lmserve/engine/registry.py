"""The engines lmserve has, in one table.

An engine is a package under engine/ (engine/llamacpp/, engine/vllm/) exporting one `SPEC` (engine/spec.py): its
name, which models it claims, its launch options (declared with the options table, so its flags, variables and help
are generated and a model on another engine refuses them), how it opens a model, and what it can do. Adding an
engine is one package and one line in `ENGINES`. Nothing here imports an engine's runtime.
"""

from __future__ import annotations

from pathlib import Path

from lmserve.engine import llamacpp, mlx, vllm
from lmserve.engine.spec import EngineSpec
from lmserve.errors import InvalidRequest

ENGINES: tuple[EngineSpec, ...] = (llamacpp.SPEC, mlx.SPEC, vllm.SPEC)
"""Every engine, in the order `--engine auto` asks them: a model goes to the first that claims it and can run on
this machine."""
AUTO = "auto"


def engine_named(name: str) -> EngineSpec:
    """The engine of this name (KeyError for none)."""
    for spec in ENGINES:
        if spec.name == name:
            return spec
    raise KeyError(name)


def engine_for(path: Path, chosen: str = AUTO) -> EngineSpec:
    """The engine that serves the model at `path`: `chosen` (an engine's name, or auto), which must claim it.

    With auto, the first engine that claims the model and has what it needs here; when none has, the first that
    claims it (opening the model then says what is missing). InvalidRequest (param "model") when the chosen engine
    does not serve this kind of model, or none does.
    """
    claimants = [spec for spec in ENGINES if spec.claims(path)]
    if chosen != AUTO:
        spec = engine_named(chosen)
        if spec in claimants:
            return spec
        other = f"; {path.name} is one of the {claimants[0].serves} that {claimants[0].label} serves" \
            if claimants else ""
        raise InvalidRequest(f"--engine {spec.name} cannot serve {path.name}: {spec.label} serves {spec.serves}"
                             f"{other}", param="model")
    if not claimants:
        kinds = "; ".join(f"{spec.label} serves {spec.serves}" for spec in ENGINES)
        raise InvalidRequest(f"no engine serves {path.name}: {kinds}", param="model")
    if len(claimants) == 1:
        return claimants[0]
    return next((spec for spec in claimants if spec.missing() is None), claimants[0])
