"""LoRA adapter routes (issue 44), over service/adapters.py:

- llama-server's `GET /lora-adapters` (`[{id, path, scale}]`, the registered adapters in id order) and
  `POST /lora-adapters` (`[{id, scale}]`: the global scales of plain requests to the served model; adapters left out go
  to 0).
- vLLM's `POST /v1/load_lora_adapter` (`{lora_name, lora_path}`) and `POST /v1/unload_lora_adapter` (`{lora_name}`),
  refused (400, as vLLM does) unless the server was started with `--runtime-lora`. A loaded adapter is the model
  `lora_name` over the served model, listed by /v1/models with its `parent`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import ServiceDep
from lmserve.errors import InvalidRequest

_WIRE = ConfigDict(extra="allow")

router = APIRouter(route_class=JsonBodyRoute)


class ScaleItem(BaseModel):
    model_config = _WIRE
    id: int = Field(ge=0)
    scale: float = Field(ge=-16.0, le=16.0, allow_inf_nan=False)


class LoadAdapter(BaseModel):
    model_config = _WIRE
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapter(BaseModel):
    model_config = _WIRE
    lora_name: str = Field(min_length=1)


@router.get("/lora-adapters")
async def list_adapters(service: ServiceDep) -> list[dict[str, Any]]:
    return [{"id": entry.id, "name": entry.name, "path": entry.path, "scale": entry.scale}
            for entry in service.loras.entries()]


@router.post("/lora-adapters")
async def set_scales(service: ServiceDep, body: list[ScaleItem]) -> list[dict[str, Any]]:
    service.loras.set_scales({item.id: item.scale for item in body})
    return await list_adapters(service)


@router.post("/v1/load_lora_adapter")
async def load_adapter(service: ServiceDep, body: LoadAdapter) -> PlainTextResponse:
    _check_runtime(service)
    entry = await asyncio.to_thread(service.loras.register, body.lora_name, body.lora_path)  # reads and copies it
    return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_adapter(service: ServiceDep, body: UnloadAdapter) -> PlainTextResponse:
    _check_runtime(service)
    if any(entry.name == body.lora_name for entry in service.loras.entries()):
        await service.models.unload(body.lora_name)  # its name leaves /api/ps; the base's instance stays
    await asyncio.to_thread(service.loras.unregister, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_runtime(service: ServiceDep) -> None:
    if not service.loras.runtime:
        raise InvalidRequest("loading and unloading LoRA adapters while serving is off: start the server with "
                             "--runtime-lora (LMSERVE_RUNTIME_LORA=1)", param="lora_name")
