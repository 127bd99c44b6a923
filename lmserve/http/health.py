"""GET /health (readiness: the resident models can answer) and GET /livez (liveness: the process is up).

/health is 200 `{"status": "ok"}` while every resident model's engine works; 503 while one is down or being
(re)loaded: `{"status": "loading" | "restarting" | "failed", "reason": …, "models": {name: {"state", "reason"}}}`, the
status the worst model's (service/residency.py `health`). Route traffic by /health; restart the process on /livez,
which answers 200 `{"status": "alive"}` whatever the models do (a failed model is restarted in the process).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lmserve.dialects.shared.state import ServiceDep
from lmserve.service.residency import ModelHealth

HEALTH_PATH = "/health"
LIVENESS_PATH = "/livez"
_SEVERITY = {"ok": 0, "loading": 1, "restarting": 2, "failed": 3}


router = APIRouter()


@router.get(HEALTH_PATH)
async def health(service: ServiceDep) -> JSONResponse:
    return health_response(service.residency.health())


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
