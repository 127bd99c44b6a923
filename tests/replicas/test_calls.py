"""A call as a replica answers it: the prompt text the router matches on, and the app run for one call (head
first, a stream streamed, a caller that leaves seen by the app as a client disconnect)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Receive, Scope, Send

from lmserve.replicas.calls import AT_ONCE, Head, HttpCall, answer, prompt_text


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_prompt_text_of_a_chat_lays_tools_and_messages_out_in_template_order() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    tools = [{"type": "function", "function": {"name": "weather"}}]
    text = prompt_text("/v1/chat/completions", body(model="m", temperature=0, tools=tools,
                                                     messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user",
                                                                "content": [{"type": "text", "text": "Hi"}, image]}]))
    assert text == "weatherBe brief.Hi"


def test_prompt_text_of_each_dialect() -> None:
    messages = [{"role": "user", "content": "Q"}]
    assert prompt_text("/v1/messages", body(model="m", system="Sys", messages=messages)) == "SysQ"
    assert prompt_text("/api/chat", body(model="m", system="Sys", messages=messages)) == "SysQ"
    assert prompt_text("/v1/responses", body(model="m", instructions="Ins", input="In")) == "InsIn"
    assert prompt_text("/v1/completions", body(model="m", prompt="Once", suffix="end")) == "Onceend"
    assert prompt_text("/api/generate", body(model="m", system="Sys", prompt="Once")) == "SysOnce"
    assert prompt_text("/v1/completions", body(model="m", prompt=["a", "b"])) == "ab"
    assert prompt_text("/v1/embeddings", body(model="m", input=["a", "b"])) == "ab"


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{not json", b"name=value"])
def test_a_body_without_a_prompt_has_none(raw: bytes) -> None:
    assert prompt_text("/v1/chat/completions", raw) == ""


def call(path: str = "/", data: bytes = b"") -> HttpCall:
    return HttpCall("POST", path, b"a=1", ((b"content-type", b"application/json"),), data, "")


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    message = await receive()
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-path", scope["path"].encode())]})
    await send({"type": "http.response.body", "body": scope["query_string"] + b" ", "more_body": True})
    await send({"type": "http.response.body", "body": message["body"], "more_body": False})


def test_answer_gives_the_head_then_the_body_pieces() -> None:
    async def run() -> list[Head | bytes]:
        return [piece async for piece in answer(echo, call("/v1/x", b"hello"))]

    assert asyncio.run(run()) == [Head(201, ((b"x-path", b"/v1/x"),)), b"a=1 ", b"hello"]


def test_a_caller_that_leaves_is_a_client_disconnect_to_the_app() -> None:
    seen: list[str] = []

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append((await receive())["type"])

    async def run() -> None:
        pieces = answer(stream, call())
        assert isinstance(await anext(pieces), Head)
        assert await anext(pieces) == b"first"
        await pieces.aclose()
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert seen == ["http.disconnect"]


def test_an_app_that_fails_before_answering_raises() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    async def run() -> None:
        async for _ in answer(broken, call()):
            pass

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run())


def test_after_the_opening_pieces_those_within_the_interval_go_together() -> None:
    async def tokens(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in [b"<"] * (AT_ONCE - 1) + [b"a", b"b", b"c"]:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await asyncio.sleep(0.3)  # longer than the interval: the next piece goes at once
        await send({"type": "http.response.body", "body": b"d", "more_body": True})
        await send({"type": "http.response.body", "body": b"e", "more_body": False})

    async def run(interval: float) -> list[Head | bytes]:
        return [piece async for piece in answer(tokens, call(), interval)]

    opening = [b"<"] * (AT_ONCE - 1)
    assert asyncio.run(run(0.1))[1:] == [*opening, b"a", b"bc", b"d", b"e"]
    assert asyncio.run(run(0.0))[1:] == [*opening, b"a", b"b", b"c", b"d", b"e"]
