"""vLLM's failures in words: its configuration errors, the death of its engine processes, a request it failed."""

from __future__ import annotations

import contextlib
import signal
from typing import Any


def config_error(exc: ValueError) -> str:
    """The reasons in a vLLM configuration error, on one line ("Total number of attention heads (9) must be …"),
    each after the field it is about when it is about one ("kv_events_config.bogus: Unexpected keyword argument")."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(_located(e.get("loc") or (), str(e.get("msg", "")).removeprefix("Value error, "))
                         for e in errors())
    return " ".join(str(exc).split())


def _located(location: tuple[object, ...], message: str) -> str:
    return f"{'.'.join(map(str, location))}: {message}" if location else message


def engine_death(llm: Any) -> str:
    """Why the AsyncLLM `llm` stopped: its engine processes that exited and how ("EngineCore process died
    (SIGKILL)"), else vLLM's own word for it."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    finished_procs = getattr(manager, "finished_procs", None)
    finished: dict[str, int] = finished_procs() if callable(finished_procs) else {}
    if finished:
        return "; ".join(f"{name} process died ({exit_status(code)})" for name, code in sorted(finished.items()))
    return "vLLM's engine core stopped (EngineDeadError)"


def exit_status(code: int) -> str:
    """A process's exit code in words: "SIGKILL" for -9, "exit code 1" for 1."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
        return f"signal {-code}"
    return f"exit code {code}"


def engine_error(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return f"the vLLM engine failed: {type(cause).__name__}: {cause}".strip()
