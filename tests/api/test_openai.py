"""The /v1 routes end to end over the fake engine, checked against the official `openai` types."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import httpx
import httpx2
import numpy as np
import openai
import pytest
from api_wire import sse_json
from fastapi import FastAPI
from openai.types import Completion
from openai.types import Model as OpenAIModel
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Say something."}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": USER, **fields}


def expected(prompt_tokens: int, num_tokens: int, seed: int = 0) -> str:
    return FakeBackend.expected(prompt_tokens, num_tokens, seed)


# ---- chat, non-streaming --------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [0, 7])
async def test_chat_body_matches_openai_types(client: httpx.AsyncClient, seed: int) -> None:
    response = await client.post(CHAT, json=chat(max_tokens=12, seed=seed))
    assert response.status_code == 200
    body = response.json()
    completion = ChatCompletion.model_validate(body)
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == "fake"
    assert body["system_fingerprint"].startswith("fp_")
    choice = body["choices"][0]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": choice["message"]["content"], "refusal": None},
        "logprobs": None,
        "finish_reason": "length",
    }
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert choice["message"]["content"] == expected(usage["prompt_tokens"], 12, seed)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("fields", "num_tokens"),
    [({"max_tokens": 5}, 5), ({"max_completion_tokens": 3, "max_tokens": 9}, 3), ({"max_completion_tokens": 4}, 4)],
)
async def test_max_tokens_gives_length(client: httpx.AsyncClient, fields: dict[str, Any], num_tokens: int) -> None:
    body = (await client.post(CHAT, json=chat(**fields))).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == num_tokens
    assert body["choices"][0]["message"]["content"] == expected(body["usage"]["prompt_tokens"], num_tokens)


@pytest.mark.asyncio
@pytest.mark.parametrize("stop", ["fox", ["zzz", "lazy"], ["dog."]])
async def test_stop_strings(client: httpx.AsyncClient, stop: str | list[str]) -> None:
    body = (await client.post(CHAT, json=chat(max_tokens=100, stop=stop))).json()
    full = expected(body["usage"]["prompt_tokens"], 100)
    stops = [stop] if isinstance(stop, str) else stop
    cut = min(full.index(s) for s in stops if s in full)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == full[:cut]


@pytest.mark.asyncio
async def test_alias_and_extra_fields_accepted(client: httpx.AsyncClient) -> None:
    request = chat(model="fake-alias", max_tokens=2, some_vendor_field={"x": 1}, metadata={"k": "v"}, user="u")
    response = await client.post(CHAT, json=request)
    assert response.status_code == 200
    assert response.json()["model"] == "fake"


@pytest.mark.asyncio
async def test_tool_messages_and_parts_accepted(client: httpx.AsyncClient) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    response = await client.post(CHAT, json=chat(messages=messages, tools=tools, tool_choice="auto", max_tokens=3))
    assert response.status_code == 200, response.text
    ChatCompletion.model_validate(response.json())


# ---- chat, streaming ------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_stream_order(client: httpx.AsyncClient, include_usage: bool) -> None:
    request = chat(max_tokens=10, stream=True, stream_options={"include_usage": include_usage})
    response = await client.post(CHAT, json=request)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks, is_done = sse_json(response.text)
    assert is_done
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk"
        assert (chunk["id"], chunk["created"]) == (chunks[0]["id"], chunks[0]["created"])
        assert chunk["system_fingerprint"].startswith("fp_")
        assert ("usage" in chunk) == include_usage
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if include_usage:
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 10
        prompt_tokens = usage_chunk["usage"]["prompt_tokens"]
        assert all(c["usage"] is None for c in chunks)
    finish = chunks.pop()
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    middle = [c["choices"][0] for c in chunks[1:]]
    assert middle and all(c["finish_reason"] is None and "role" not in c["delta"] for c in middle)
    text = "".join(c["delta"]["content"] for c in middle)
    if include_usage:
        assert text == expected(prompt_tokens, 10)
    else:
        assert len(text) == 10


@pytest.mark.asyncio
async def test_chat_stream_stop_string(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat(max_tokens=100, stream=True, stop=["dog"]))
    chunks, _ = sse_json(response.text)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "dog" not in text and len(text) < 100
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- completions ----------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt", ["Once upon a time", ["Once upon a time"]])
async def test_completion(client: httpx.AsyncClient, prompt: str | list[str]) -> None:
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 8})
    assert response.status_code == 200
    body = response.json()
    Completion.model_validate(body)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len("Once upon a time")
    assert choice["text"] == expected(len("Once upon a time"), 8)


@pytest.mark.asyncio
async def test_completion_echo(client: httpx.AsyncClient) -> None:
    request = {"model": "fake", "prompt": "abc", "max_tokens": 4, "echo": True}
    body = (await client.post("/v1/completions", json=request)).json()
    assert body["choices"][0]["text"] == "abc" + expected(3, 4)


@pytest.mark.asyncio
async def test_a_prompt_of_token_ids_is_taken_as_it_is(client: httpx.AsyncClient) -> None:
    ids = list(b"Once upon")
    body = (await client.post("/v1/completions", json={"model": "fake", "prompt": ids, "max_tokens": 5,
                                                       "echo": True})).json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == "Once upon" + expected(len(ids), 5)  # echoed as the model's text


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_several_prompts_are_answered_in_prompt_order_n_choices_each(client: httpx.AsyncClient,
                                                                           stream: bool) -> None:
    prompts: list[Any] = ["ab", list(b"abcd"), "abcdef"]  # texts and token ids are two shapes, not mixed: a list each
    texts, id_lists = [p for p in prompts if isinstance(p, str)], [p for p in prompts if isinstance(p, list)]
    for given in (texts, id_lists):
        request = {"model": "fake", "prompt": given, "max_tokens": 3, "n": 2, "seed": 5, "stream": stream,
                   "stream_options": {"include_usage": True} if stream else None}
        response = await client.post("/v1/completions", json=request)
        assert response.status_code == 200, response.text
        if stream:
            chunks, _ = sse_json(response.text)
            usage = chunks.pop()["usage"]
            text: dict[int, str] = {}
            for chunk in chunks:
                for choice in chunk["choices"]:
                    text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
        else:
            body = response.json()
            usage, text = body["usage"], {c["index"]: c["text"] for c in body["choices"]}
        sizes = [len(p) for p in given]
        assert sorted(text) == list(range(2 * len(given)))  # choice i * n + j: prompt i's j-th
        assert text == {2 * i + j: expected(size, 3, 5 + j) for i, size in enumerate(sizes) for j in range(2)}
        assert usage["prompt_tokens"] == sum(sizes) and usage["completion_tokens"] == 3 * 2 * len(given)


def fake_prompt_logprob(before: int, token: int) -> float:
    """The fake's log-probability of `token` after `before` (FakeBackend.prompt_row)."""
    row = -((np.arange(257) + before) % 7).astype(np.float64)
    return float(row[token] - (row.max() + np.log(np.exp(row - row.max()).sum())))


@pytest.mark.asyncio
@pytest.mark.parametrize(("prompt", "max_tokens"), [("abcd", 3), (list(b"abcd"), 1), ("abcd", 0)])
async def test_echo_with_logprobs_gives_the_prompts_tokens_first(client: httpx.AsyncClient, prompt: Any,
                                                                 max_tokens: int) -> None:
    """As lm-evaluation-harness scores a choice: `echo`, `logprobs: 1`, and the prompt's log-probabilities read
    from `token_logprobs` (the first token has none); `max_tokens: 0` gives the prompt's alone (as vLLM does)."""
    request = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1}
    whole = (await client.post("/v1/completions", json=request)).json()
    [choice] = whole["choices"]
    shaped = choice["logprobs"]
    ids = list(b"abcd")
    assert shaped["tokens"][:4] == ["a", "b", "c", "d"] and shaped["token_logprobs"][0] is None
    assert shaped["top_logprobs"][0] is None and shaped["text_offset"][:4] == [0, 1, 2, 3]
    assert shaped["token_logprobs"][1:4] == pytest.approx([fake_prompt_logprob(b, t) for b, t in pairwise(ids)])
    assert all(top[token] == value for token, value, top in
               zip(shaped["tokens"][1:4], shaped["token_logprobs"][1:4], shaped["top_logprobs"][1:4], strict=True))
    assert len(shaped["tokens"]) == 4  # the fake ranks no generated token (real engines: tests/test_logprobs_e2e.py)
    assert whole["usage"]["completion_tokens"] == max_tokens
    assert choice["text"] == "abcd" + expected(4, max_tokens)
    streamed, _ = sse_json((await client.post("/v1/completions", json={**request, "stream": True})).text)
    merged_tokens = [t for c in streamed for ch in c["choices"] for t in (ch["logprobs"] or {}).get("tokens", [])]
    assert merged_tokens == shaped["tokens"]
    assert "".join(ch["text"] for c in streamed for ch in c["choices"]) == choice["text"]


@pytest.mark.asyncio
@pytest.mark.parametrize("include_usage", [False, True])
async def test_completion_stream(client: httpx.AsyncClient, include_usage: bool) -> None:
    request = {"model": "fake", "prompt": "abcd", "max_tokens": 6, "stream": True}
    request["stream_options"] = {"include_usage": include_usage}
    chunks, is_done = sse_json((await client.post("/v1/completions", json=request)).text)
    assert is_done
    for chunk in chunks:  # the spec says finish_reason is non-null, but streams send null until the end
        patched = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        Completion.model_validate({**chunk, "choices": patched})
        assert chunk["object"] == "text_completion"
        assert chunk["id"] == chunks[0]["id"]
    if include_usage:
        assert chunks.pop()["usage"]["completion_tokens"] == 6
    assert chunks[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected(4, 6)


# ---- models ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_list_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [OpenAIModel.model_validate(m).id for m in body["data"]] == ["fake"]
    assert set(body["data"][0]) == {"id", "object", "created", "owned_by"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("served", "listed"),
    [(None, ["newest", "served", "oldest"]), ("served", ["served", "newest", "oldest"]),
     ("oldest", ["oldest", "newest", "served"])],
)
async def test_the_served_model_is_listed_first(engine: BatchingEngine, served: str | None,
                                                listed: list[str]) -> None:
    """The model the server was started with comes first (the web page starts on it), then newest first."""
    models = [LoadedModel(name=name, engine=engine, template=ChatTemplate(None))
              for name in ("newest", "served", "oldest")]
    app = create_app(static_service(models), ServerConfig(), served=served)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        body = (await client.get("/v1/models")).json()
    assert [model["id"] for model in body["data"]] == listed


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["fake", "fake-alias"])
async def test_get_model(client: httpx.AsyncClient, name: str) -> None:
    response = await client.get(f"/v1/models/{name}")
    assert response.status_code == 200
    assert OpenAIModel.model_validate(response.json()).id == "fake"


# ---- the official client, with strict response validation -----------------------------------------


@pytest.mark.asyncio
async def test_official_client(app: FastAPI) -> None:
    transport = httpx2.ASGITransport(app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        strict = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=http, _strict_response_validation=True
        )
        # streamed legacy chunks carry finish_reason null until the last, as OpenAI's do, which the spec (and so
        # the strict client) does not allow: those are read with the default, lenient client
        lenient = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
        await _exercise(strict, lenient)


async def _exercise(oai: openai.AsyncOpenAI, lenient: openai.AsyncOpenAI) -> None:
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    completion = await oai.chat.completions.create(model="fake", messages=hi, max_tokens=5)
    assert completion.choices[0].finish_reason == "length"
    stream = await oai.chat.completions.create(
        model="fake", messages=hi, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    pieces = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == completion.choices[0].message.content
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 5
    legacy = await oai.completions.create(model="fake", prompt="abc", max_tokens=3)
    assert legacy.choices[0].text == expected(3, 3)
    legacy_stream = await lenient.completions.create(model="fake", prompt="abc", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in legacy_stream]) == expected(3, 3)
    assert [m.id async for m in oai.models.list()] == ["fake"]
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model="fake", messages=[], max_tokens=5)
    assert info.value.code is None and info.value.param == "messages"
