"""The native dialect over the fake engine: NDJSON streams, final fields, errors, keep-alive parsing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from lmserve.dialects.native.modelfiles import to_modelfile
from lmserve.dialects.native.schemas import ChatMessage, CreateBody
from lmserve.dialects.native.translate import parse_keep_alive, split_reasoning, to_messages, to_options
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest
from lmserve.service import Service
from lmserve.types import RequestOptions

FINAL_FIELDS = {"done", "done_reason", "total_duration", "load_duration", "prompt_eval_count",
                "prompt_eval_duration", "eval_count", "eval_duration"}


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line]


async def test_generate_streams_ndjson_and_ends_with_durations(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/generate", json={"model": "fake", "prompt": "hello", "raw": True,
                                                  "options": {"num_predict": 6}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(r.text)
    assert all(not line["done"] for line in lines[:-1])
    assert "".join(line["response"] for line in lines) == FakeBackend.expected(5, 6)
    last = lines[-1]
    assert set(last) >= FINAL_FIELDS
    assert last["done_reason"] == "length"
    assert (last["prompt_eval_count"], last["eval_count"]) == (5, 6)
    assert last["context"][:5] == list(b"hello") and len(last["context"]) == 11
    assert all(isinstance(last[k], int) for k in FINAL_FIELDS - {"done", "done_reason"})


async def test_generate_without_stream_returns_one_object(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/generate", json={"model": "fake", "prompt": "hello", "raw": True, "stream": False,
                                                  "options": {"num_predict": 4}})
    body = r.json()
    assert body["response"] == FakeBackend.expected(5, 4)
    assert body["done"] is True and body["model"] == "fake"


async def test_generate_applies_the_chat_template_unless_raw(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/generate", json={"model": "fake", "prompt": "hi", "stream": False,
                                                  "system": "be brief", "options": {"num_predict": 1}})
    prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert r.json()["prompt_eval_count"] == len(prompt.encode())


async def test_chat_streams_messages(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/chat", json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                              "options": {"num_predict": 5, "stop": ["zzz"]}})
    lines = ndjson(r.text)
    assert all(line["message"]["role"] == "assistant" for line in lines)
    assert lines[-1]["done"] is True and set(lines[-1]) >= FINAL_FIELDS
    assert len("".join(line["message"]["content"] for line in lines)) == 5


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/api/generate", {"model": "fake"}),
        ("/api/chat", {"model": "fake", "messages": []}),
    ],
)
async def test_empty_prompt_loads_and_keep_alive_zero_unloads(
    client: httpx.AsyncClient, route: str, body: dict[str, Any]
) -> None:
    r = await client.post(route, json=body)
    assert r.json()["done_reason"] == "load"
    r = await client.post(route, json={**body, "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    assert (await client.get("/api/ps")).json() == {"models": []}
    r = await client.post("/api/generate", json={"model": "fake", "prompt": "x", "raw": True, "stream": False,
                                                  "options": {"num_predict": 2}})
    assert r.json()["response"] == FakeBackend.expected(1, 2)  # loads again and answers


@pytest.mark.parametrize(
    ("route", "body", "status"),
    [
        ("/api/generate", {"prompt": "hi"}, 400),
        ("/api/generate", {"model": "nope", "prompt": "hi"}, 404),
        ("/api/generate", {"model": "fake", "prompt": "hi", "options": {"temperature": "hot"}}, 400),
        ("/api/generate", {"model": "fake", "prompt": "hi", "keep_alive": "soon"}, 400),
        ("/api/generate", {"model": "fake", "prompt": "hi", "images": ["aGk="]}, 400),
        ("/api/generate", {"model": "fake", "prompt": "def f(", "suffix": "return x"}, 400),
        ("/api/generate", {"model": "fake", "prompt": "hi", "raw": True, "context": [999999]}, 400),
        ("/api/chat", {"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
        ("/api/show", {"model": "nope"}, 404),
        ("/api/copy", {"source": "fake", "destination": "other"}, 400),
    ],
)
async def test_errors_use_the_native_body(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], status: int
) -> None:
    r = await client.post(route, json=body)
    assert r.status_code == status
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)


async def test_version_is_the_local_runner_release_the_routes_follow_with_lmserves_own_beside_it(
        client: httpx.AsyncClient) -> None:
    from lmserve import __version__

    answer = await client.get("/api/version")
    version = answer.json()["version"]
    assert tuple(int(part) for part in version.split(".")) >= (0, 6, 4)  # what VS Code's provider requires
    assert answer.json()["lmserve_version"] == __version__ == answer.headers["x-lmserve-version"]


async def test_management_routes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/")).text == "lmserve is running"
    tags = (await client.get("/api/tags")).json()["models"]
    assert [t["name"] for t in tags] == ["fake"]
    show = (await client.post("/api/show", json={"model": "fake"})).json()
    assert show["capabilities"] == ["completion", "tools", "rerank"] and "FROM" in show["modelfile"]
    await client.post("/api/generate", json={"model": "fake"})
    ps = (await client.get("/api/ps")).json()["models"]
    assert [m["name"] for m in ps] == ["fake"] and "expires_at" in ps[0]
    assert ps[0]["context_length"] == 2048


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("300", 300.0), (0, 0.0), (-1, -1.0),
     ("-1", -1.0), ("1.5h", 5400.0), ("250ms", 0.25)],
)
def test_keep_alive_durations(value: str | int | None, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", "5x"])
def test_bad_keep_alive_is_refused(value: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_keep_alive(value)


def test_options_are_checked_and_typed_over_the_native_defaults() -> None:
    asked = to_options({"temperature": 0.7, "num_predict": -1, "stop": "x", "num_ctx": 1024})
    assert asked == RequestOptions({"temperature": 0.7, "num_predict": None, "stop": ["x"], "num_ctx": 1024}, "native")
    assert to_options(None) == RequestOptions(defaults="native")


async def test_a_full_queue_is_503_with_retry_after() -> None:
    import asyncio

    from lmserve.chat.template import ChatTemplate
    from lmserve.config import ServerConfig
    from lmserve.engine.slots.batching import BatchingEngine
    from lmserve.http.app import create_app
    from lmserve.service import static_service
    from lmserve.service.residency import LoadedModel

    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=1, step_delay=0.02), max_queue=1)
    app = create_app(static_service([LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))]),
                     ServerConfig())
    body = {"model": "fake", "prompt": "x", "raw": True, "stream": False, "options": {"num_predict": 5}}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            replies = await asyncio.gather(*(client.post("/api/generate", json=body) for _ in range(6)))
            openai_reply = None
            for _ in range(3):
                busy = [client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 5})
                        for _ in range(6)]
                for r in await asyncio.gather(*busy):
                    if r.status_code == 503:
                        openai_reply = r
    finally:
        engine.close()
    statuses = sorted(r.status_code for r in replies)
    assert 503 in statuses and 200 in statuses
    refused = next(r for r in replies if r.status_code == 503)
    assert refused.headers["retry-after"] and set(refused.json()) == {"error"}
    assert all(r.json()["done"] for r in replies if r.status_code == 200)
    assert openai_reply is not None and openai_reply.json()["error"]["type"] == "overloaded_error"


async def test_too_many_messages_is_400(service: Service, client: httpx.AsyncClient) -> None:
    service.generation.max_messages = 3
    messages = [{"role": "user", "content": "hi"}] * 4
    r = await client.post("/api/chat", json={"model": "fake", "messages": messages, "stream": False})
    assert r.status_code == 400 and "messages" in r.json()["error"]
    r = await client.post("/v1/chat/completions", json={"model": "fake", "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("options", [{"num_batch": 10**6}, {"num_thread": 10**6}, {"repeat_last_n": -2}])
async def test_absurd_load_options_are_refused(client: httpx.AsyncClient, options: dict[str, int]) -> None:
    r = await client.post("/api/generate", json={"model": "fake", "prompt": "x", "options": options})
    assert r.status_code == 400


def test_an_assistant_messages_thinking_is_kept_with_it() -> None:
    messages = [ChatMessage(role="user", content="2+2?"), ChatMessage(role="assistant", content="4", thinking="Add.")]
    assert [m.thinking for m in to_messages(messages)] == ["", "Add."]


def test_create_fields_go_over_the_modelfile_text_and_add_to_its_lists() -> None:
    body = CreateBody.model_validate({
        "model": "m", "modelfile": "FROM base\nSYSTEM old\nPARAMETER top_k 5\nMESSAGE user hi\nLICENSE a",
        "system": "new", "parameters": {"temperature": 0.5}, "messages": [{"role": "assistant", "content": "yo"}],
        "license": "b",
    })
    modelfile = to_modelfile(body)
    assert (modelfile.from_, modelfile.system, modelfile.template) == ("base", "new", None)
    assert modelfile.parameters == {"top_k": 5, "temperature": 0.5}
    assert modelfile.messages == [("user", "hi"), ("assistant", "yo")]
    assert modelfile.license == ["b"]
    assert to_modelfile(CreateBody.model_validate({"model": "m", "from": "base"})).license == []


@pytest.mark.parametrize(("options", "think", "expected"), [
    ({"reasoning_effort": "medium", "num_ctx": 8}, None, ({"num_ctx": 8}, None, "medium")),  # Open WebUI's param
    ({"reasoning_effort": "none"}, None, ({}, None, False)),
    ({"reasoning_effort": "High", "reasoning_budget": 5}, None, ({}, 5, "high")),
    ({"reasoning_effort": "low"}, True, ({}, None, True)),  # the request's own think wins
    ({"temperature": 0}, None, ({"temperature": 0}, None, None)),
    (None, "low", (None, None, "low")),
])
def test_the_reasoning_options_are_taken_out_of_options(options: dict[str, Any] | None, think: bool | str | None,
                                                       expected: tuple[Any, ...]) -> None:
    assert split_reasoning(options, think) == expected


@pytest.mark.parametrize("options", [{"reasoning_effort": "extreme"}, {"reasoning_effort": 2},
                                     {"reasoning_budget": -1}, {"reasoning_budget": True}])
def test_bad_reasoning_options_are_a_400_naming_them(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        split_reasoning(options, None)
    assert caught.value.param == next(iter(options))
