"""/api/pull in-process: the service's progress records as NDJSON lines, or one `success` body; a bad name is an
ordinary 400 before any line. The embedded model is pulled (restored from its package: no network)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from lmserve.config import ServerConfig
from lmserve.engine.protocol import Engine
from lmserve.http.app import create_app
from lmserve.service import Service
from lmserve.service.catalog import StoreCatalog
from lmserve.service.residency import Residency
from lmserve.store.embedded import DEFAULT_MODEL_NAME, embedded_model_path
from lmserve.store.store import Store
from lmserve.types import LoadOptions


def never_opened(path: Path, options: LoadOptions) -> Engine:
    raise AssertionError("pulling loads nothing")


@pytest_asyncio.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    catalog = StoreCatalog(Store(tmp_path / "store"), never_opened)
    service = Service(catalog, Residency(catalog.plan))
    app = create_app(service, ServerConfig(models_dir=str(tmp_path / "store")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    service.close()


async def test_a_streamed_pull_is_its_progress_as_lines(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/pull", json={"model": DEFAULT_MODEL_NAME})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson"), r.text
    lines = [json.loads(text) for text in r.text.splitlines()]
    size = embedded_model_path().stat().st_size
    pulled = lines[1]
    assert [line["status"] for line in lines] == [
        "pulling manifest", f"pulling {embedded_model_path().name}", "writing manifest", "success"]
    assert (pulled["total"], pulled["completed"], pulled["digest"].startswith("sha256:")) == (size, size, True)
    assert set(lines[0]) == {"status"}  # no empty fields
    shown = await client.post("/api/show", json={"model": DEFAULT_MODEL_NAME})
    assert shown.status_code == 200, shown.text


async def test_a_pull_that_is_not_streamed_answers_success(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/pull", json={"model": DEFAULT_MODEL_NAME, "stream": False})
    assert (r.status_code, r.json()) == (200, {"status": "success"})


@pytest.mark.parametrize("stream", [True, False])
async def test_a_name_that_cannot_be_pulled_is_a_400_before_any_line(client: httpx.AsyncClient, stream: bool) -> None:
    r = await client.post("/api/pull", json={"model": "pirate", "stream": stream})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and "cannot pull 'pirate'" in r.json()["error"]
