"""GET /health (readiness: the resident models can answer), GET /health/decode (progress: each one decodes) and
GET /livez (liveness: the process is up).

/health is 200 `{"status": "ok"}` while every resident model's engine works; 503 while one is down or being
(re)loaded: `{"status": "loading" | "restarting" | "failed", "reason": …, "models": {name: {"state", "reason"}}}`, the
status the worst model's (service/residency.py `health`). Route traffic by /health; restart the process on /livez,
which answers 200 `{"status": "alive"}` whatever the models do (a failed model is restarted in the process).

/health/decode shows each resident model decoding within `timeout` seconds (10; at most 300): a working engine
observed making progress, an idle one probed with one token (service/decode_health.py). It may run a probe, so
unlike /health it is behind the API key when one is set. 200 `{"status": "ok", "models": {name: {"state": "ok",
"check": "observed" | "probed" | "idle", "seconds": …}}}`; 503 with status `stuck` (the model's reason: no decode
step within the deadline) or the worst of /health's states.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from lmserve.dialects.shared.state import ServiceDep
from lmserve.service.decode_health import DEFAULT_DEADLINE_S, MAX_DEADLINE_S, DecodeHealth, check
from lmserve.service.residency import ModelHealth

HEALTH_PATH = "/health"
LIVENESS_PATH = "/livez"
_SEVERITY = {"ok": 0, "loading": 1, "restarting": 2, "stuck": 3, "failed": 4}
Deadline = Annotated[float, Query(gt=0, le=MAX_DEADLINE_S, description="seconds each model has to show a decode")]


router = APIRouter()


@router.get(HEALTH_PATH)
async def health(service: ServiceDep) -> JSONResponse:
    return health_response(service.residency.health())


@router.get(HEALTH_PATH + "/decode")
async def decode_health(service: ServiceDep, timeout: Deadline = DEFAULT_DEADLINE_S) -> JSONResponse:
    residency = service.residency
    checks = await asyncio.gather(*(check(names, engine, timeout) for names, engine in residency.decoders()))
    return decode_response(residency.health(), checks)


@router.get(LIVENESS_PATH)
async def liveness() -> dict[str, str]:
    return {"status": "alive"}


def health_response(states: list[ModelHealth]) -> JSONResponse:
    """200 when every model in `states` is ok; else 503 naming the worst state and each model's."""
    down = [s for s in states if s.state != "ok"]
    if not down:
        return JSONResponse({"status": "ok"})
    worst = max(down, key=lambda s: _SEVERITY[s.state]).state
    models = {s.name: {"state": s.state, "reason": s.reason} if s.reason else {"state": s.state} for s in states}
    reason = "; ".join(f"{s.name}: {s.reason}" for s in down)
    return JSONResponse({"status": worst, "reason": reason, "models": models}, status_code=503,
                        headers={"Retry-After": "1"})


def decode_response(states: list[ModelHealth], checks: list[DecodeHealth]) -> JSONResponse:
    """200 when every model showed a decode and none is down; else 503 naming each model that did not."""
    models: dict[str, dict[str, Any]] = {}
    reasons: list[str] = []
    for found in checks:
        for name in found.names:
            models[name] = {"state": "ok" if found.ok else found.check, "check": found.check,
                            "seconds": round(found.seconds, 3)} | ({"reason": found.reason} if found.reason else {})
            if not found.ok:
                reasons.append(f"{name}: {found.reason}")
    for state in states:
        if state.state != "ok":
            models[state.name] = {"state": state.state} | ({"reason": state.reason} if state.reason else {})
            reasons.append(f"{state.name}: {state.reason or state.state}")
    if not reasons:
        return JSONResponse({"status": "ok", "models": models})
    worst = max((entry["state"] for entry in models.values()), key=lambda state: _SEVERITY.get(state, 0))
    return JSONResponse({"status": worst, "reason": "; ".join(reasons), "models": models}, status_code=503,
                        headers={"Retry-After": "1"})
