"""`/v1/files` in-process, through the official `openai` client and over plain HTTP: upload (multipart), list
(pages, purpose, order), retrieve, content, delete; the upload limit (LMSERVE_FILES_MAX_UPLOAD, not
LMSERVE_MAX_BODY); every error a 4xx in the OpenAI shape; behind the API key; the store shared on `app.state.files`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from api_wire import API_KEY, assert_openai_error
from fastapi import FastAPI

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig, env_name
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.http.guards import FORM_ALLOWANCE
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.store.files import FileStore

BASE = "http://test"
BATCH = b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
LIMIT = 1000


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2))
    yield engine
    engine.close()


def app_for(engine: BatchingEngine, tmp_path: Path, **config: Any) -> FastAPI:
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))
    return create_app(static_service([model]), ServerConfig(models_dir=str(tmp_path), **config))


@pytest.fixture
def app(engine: BatchingEngine, tmp_path: Path) -> FastAPI:
    return app_for(engine, tmp_path, files_max_upload=LIMIT, max_body_bytes=LIMIT // 2)


@pytest_asyncio.fixture
async def http(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=BASE) as client:
        yield client


def client_of(http: httpx.AsyncClient, api_key: str = "x") -> openai.AsyncOpenAI:
    # openai types its client as httpx2's, and takes a (legacy) httpx client too
    return openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=api_key, http_client=http,  # type: ignore[arg-type]
                              max_retries=0, _strict_response_validation=True)


def error_of(caught: pytest.ExceptionInfo[openai.APIStatusError], status: int) -> dict[str, Any]:
    assert caught.value.status_code == status
    error: dict[str, Any] = assert_openai_error(caught.value.response.json(), error_type="invalid_request_error")
    return error


# ---- the round trip through the openai client ---------------------------------------------------------------


async def test_a_file_goes_up_reads_back_and_is_deleted(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    made = await client.files.create(file=("input.jsonl", BATCH), purpose="batch")
    assert made.id.startswith("file-") and made.object == "file" and made.status == "processed"
    assert (made.filename, made.purpose, made.bytes) == ("input.jsonl", "batch", len(BATCH))
    assert made.expires_at == made.created_at + 30 * 86400
    assert await client.files.retrieve(made.id) == made
    assert (await client.files.list()).data == [made]
    content = await client.files.content(made.id)
    assert content.read() == BATCH and content.text == BATCH.decode()
    assert content.response.headers["content-type"] == "application/jsonl"
    deleted = await client.files.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "file", True)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            await call(made.id)
        assert error_of(caught, 404)["code"] == "not_found"


async def test_pages_follow_the_cursor_newest_first(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    ids = [(await client.files.create(file=(f"{i}.jsonl", BATCH), purpose="batch")).id for i in range(5)]
    await client.files.create(file=("u.txt", b"u"), purpose="user_data")
    page = await client.files.list(purpose="batch", limit=2)
    assert [f.id for f in page.data] == [ids[4], ids[3]] and page.has_more
    assert [f.id async for f in client.files.list(purpose="batch", limit=2)] == ids[::-1]
    assert [f.id async for f in client.files.list(purpose="batch", limit=2, order="asc")] == ids
    body = (await http.get("/v1/files", params={"purpose": "batch", "limit": 2, "after": ids[1]})).json()
    assert body == {"object": "list", "data": [(await client.files.retrieve(ids[0])).to_dict()],
                    "first_id": ids[0], "last_id": ids[0], "has_more": False}
    assert (await http.get("/v1/files", params={"purpose": "vision"})).json()["first_id"] is None


async def test_expires_after_shortens_a_files_life(http: httpx.AsyncClient) -> None:
    made = await client_of(http).files.create(file=("a.jsonl", BATCH), purpose="batch",
                                              expires_after={"anchor": "created_at", "seconds": 3600})
    assert made.expires_at == made.created_at + 3600


async def test_content_is_octet_stream_unless_jsonl_and_keeps_its_name(http: httpx.AsyncClient) -> None:
    raw = bytes(range(256)) * 3
    made = (await http.post("/v1/files", files={"file": ("pic ü.png", raw)}, data={"purpose": "vision"})).json()
    response = await http.get(f"/v1/files/{made['id']}/content")
    assert response.status_code == 200 and response.content == raw
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["content-length"] == str(len(raw))
    assert "attachment" in response.headers["content-disposition"]


# ---- the upload limit ----------------------------------------------------------------------------------------


async def test_an_upload_past_files_max_upload_is_413_and_keeps_nothing(http: httpx.AsyncClient,
                                                                        tmp_path: Path) -> None:
    client = client_of(http)
    assert (await client.files.create(file=("at.jsonl", b"x" * LIMIT), purpose="batch")).bytes == LIMIT
    with pytest.raises(openai.APIStatusError) as caught:
        await client.files.create(file=("over.jsonl", b"x" * (LIMIT + 1)), purpose="batch")
    error = error_of(caught, 413)
    assert error["code"] == "file_too_large" and error["param"] == "file"
    assert f"{LIMIT} bytes" in error["message"] and env_name("files_max_upload") in error["message"]
    assert [f.filename for f in (await client.files.list()).data] == ["at.jsonl"]
    assert len(list((tmp_path / "files").iterdir())) == 2


async def test_uploads_are_bounded_by_files_max_upload_not_max_body(http: httpx.AsyncClient) -> None:
    """LIMIT // 2 is the body limit: an upload of LIMIT passes it; other routes keep it."""
    chat = {"model": "fake", "messages": [{"role": "user", "content": "x" * LIMIT}]}
    response = await http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 413
    assert env_name("max_body_bytes") in assert_openai_error(response.json())["message"]
    assert (await http.post("/v1/files", files={"file": ("a", b"x" * LIMIT)}, data={"purpose": "batch"})).is_success


FILE_PART = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'


async def huge(size: int) -> AsyncIterator[bytes]:
    """A multipart form whose file part runs on past `size` bytes."""
    yield FILE_PART
    for _ in range(size // 65536 + 1):
        yield b"x" * 65536


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_far_past_the_upload_limit_is_refused_by_the_guard(http: httpx.AsyncClient,
                                                                        chunked: bool) -> None:
    size = LIMIT + FORM_ALLOWANCE + 1
    headers = {"content-type": "multipart/form-data; boundary=b"}
    content: Any = huge(size) if chunked else FILE_PART + b"x" * size
    response = await http.post("/v1/files", content=content, headers=headers)
    assert response.status_code == 413
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert error["code"] == "request_too_large" and env_name("files_max_upload") in error["message"]


# ---- bad requests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("files", "data", "param"), [
    ({"file": ("a.jsonl", BATCH)}, {"purpose": "batch_output"}, "purpose"),  # made by the server only
    ({"file": ("a.jsonl", BATCH)}, {"purpose": "nonsense"}, "purpose"),
    ({"file": ("a.jsonl", BATCH)}, {}, "purpose"),
    ({}, {"purpose": "batch"}, "file"),
    (None, {"purpose": "batch", "file": "not a file"}, "file"),
    ({"file": ("a", BATCH)}, {"purpose": "batch", "expires_after[seconds]": "60",
                              "expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    ({"file": ("a", BATCH)}, {"purpose": "batch", "expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    ({"file": ("a", BATCH)}, {"purpose": "batch", "expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"file": ("a", BATCH)}, {"purpose": "batch", "expires_after[seconds]": "3600",
                              "expires_after[anchor]": "last_used"}, "expires_after[anchor]"),
], ids=["server-purpose", "bad-purpose", "no-purpose", "no-file", "file-as-text", "expiry-too-soon", "no-seconds",
        "no-anchor", "bad-anchor"])
async def test_a_bad_upload_is_a_400_naming_its_parameter(http: httpx.AsyncClient, files: Any, data: dict[str, str],
                                                          param: str) -> None:
    if files == {}:  # a multipart form without a file part
        files = {"other": ("x", b"x")}
    response = await http.post("/v1/files", files=files, data=data)
    assert response.status_code == 400, response.text
    assert assert_openai_error(response.json(), error_type="invalid_request_error")["param"] == param
    assert (await http.get("/v1/files")).json()["data"] == []


async def test_a_bad_purpose_through_the_client_is_a_400(http: httpx.AsyncClient) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client_of(http).files.create(file=("a.jsonl", BATCH), purpose="nonsense")  # type: ignore[arg-type]
    assert error_of(caught, 400)["param"] == "purpose"


@pytest.mark.parametrize(("params", "param"), [
    ({"limit": "0"}, "limit"),
    ({"limit": "10001"}, "limit"),
    ({"limit": "ten"}, "limit"),
    ({"order": "sideways"}, "order"),
    ({"after": "chatcmpl-1"}, "after"),
])
async def test_a_bad_listing_parameter_is_a_400(http: httpx.AsyncClient, params: dict[str, str], param: str) -> None:
    response = await http.get("/v1/files", params=params)
    assert response.status_code == 400
    assert assert_openai_error(response.json(), error_type="invalid_request_error")["param"] == param


@pytest.mark.parametrize("path", ["/v1/files/file-nope", "/v1/files/file-nope/content", "/v1/files/file-..%5Csecrets",
                                  "/v1/files/chatcmpl-1"])
async def test_an_unknown_id_is_a_404(http: httpx.AsyncClient, path: str) -> None:
    for method in ("GET", "DELETE") if not path.endswith("content") else ("GET",):
        response = await http.request(method, path)
        assert response.status_code == 404
        error = assert_openai_error(response.json(), error_type="invalid_request_error")
        assert (error["code"], error["param"]) == ("not_found", "file_id")


# ---- sharing and the key ----------------------------------------------------------------------------------------


async def test_the_store_is_shared_on_app_state(app: FastAPI, http: httpx.AsyncClient, tmp_path: Path) -> None:
    store = app.state.files
    assert isinstance(store, FileStore) and store.root == tmp_path / "files"
    output = tmp_path / "output.jsonl"
    output.write_bytes(b"done\n")
    adopted = store.adopt(output, "batch_output.jsonl", "batch_output")
    listed = await client_of(http).files.list(purpose="batch_output")
    assert [f.id for f in listed.data] == [adopted.id]


async def test_the_routes_need_the_key_when_one_is_set(engine: BatchingEngine, tmp_path: Path) -> None:
    app = app_for(engine, tmp_path, api_key=API_KEY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=BASE) as http:
        with pytest.raises(openai.AuthenticationError):
            await client_of(http).files.list()
        made = await client_of(http, API_KEY).files.create(file=("a.jsonl", BATCH), purpose="batch")
        assert (await client_of(http, API_KEY).files.retrieve(made.id)).id == made.id
