"""POST /sleep, POST /wake_up and GET /is_sleeping: vLLM's routes for giving back a model's memory while the server
keeps it, on every engine (service/residency/sleeping.py says what each level frees).

- `POST /sleep?level=1|2&model=NAME`: level 1 (the default, as vLLM's) frees the KV cache and slots and keeps the
  weights; level 2 frees the weights too. Without `model`, every loaded model sleeps. 200 `{"sleeping": {name:
  level}}`; 400 for a model not loaded or an engine that cannot sleep at level 1 (naming why); 409 while the model
  serves requests.
- `POST /wake_up?model=NAME`: wakes it (every sleeping model without `model`). 200 `{"woken": [names], "sleeping":
  {…}}`. A request to a sleeping model wakes it too, and is answered.
- `GET /is_sleeping?model=NAME`: `{"is_sleeping": bool, "sleeping": {name: level}}`; without `model`, whether any
  model sleeps.

Like /health/decode, these are behind the API key when one is set.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from lmserve.dialects.shared.state import ServiceDep
from lmserve.service import Service

router = APIRouter()

Level = Annotated[int, Query(ge=1, le=2, description="1: free the KV cache, keep the weights; 2: the weights too")]
ModelName = Annotated[str | None, Query(description="the model (every loaded one when absent)")]


@router.post("/sleep")
async def sleep(service: ServiceDep, level: Level = 1, model: ModelName = None) -> dict[str, Any]:
    residency = service.residency
    await residency.sleep(_names(service, model), level)
    return {"sleeping": residency.sleeping()}


@router.post("/wake_up")
async def wake_up(service: ServiceDep, model: ModelName = None) -> dict[str, Any]:
    residency = service.residency
    woken = await residency.wake_up(_names(service, model))
    return {"woken": woken, "sleeping": residency.sleeping()}


@router.get("/is_sleeping")
async def is_sleeping(service: ServiceDep, model: ModelName = None) -> dict[str, Any]:
    sleeping = service.residency.sleeping()
    names = _names(service, model)
    return {"is_sleeping": any(name in sleeping for name in names) if names else bool(sleeping),
            "sleeping": sleeping}


def _names(service: Service, model: str | None) -> list[str] | None:
    return None if model is None else [service.catalog.resolve(model)]
