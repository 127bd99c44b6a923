"""POST /tokenize and /detokenize over the fake engine (its tokens are a text's UTF-8 bytes): llama-server's shapes
(`content`, `with_pieces`) and vLLM's (`prompt` or `messages`; `count`, `max_model_len`) on the same routes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_wire import assert_openai_error


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.asyncio
async def test_llama_server_tokenize_gives_ids(client: httpx.AsyncClient) -> None:
    assert await post(client, "/tokenize", {"content": "hi"}) == {"tokens": [104, 105]}


@pytest.mark.asyncio
async def test_pieces_are_text_or_bytes_when_not_valid_utf8(client: httpx.AsyncClient) -> None:
    body = await post(client, "/tokenize", {"content": "aá", "with_pieces": True})
    assert body == {"tokens": [{"id": 97, "piece": "a"}, {"id": 195, "piece": [195]}, {"id": 161, "piece": [161]}]}


@pytest.mark.asyncio
async def test_the_model_field_names_the_model(client: httpx.AsyncClient) -> None:
    assert await post(client, "/tokenize", {"model": "fake-alias", "content": "x"}) == {"tokens": [120]}


@pytest.mark.asyncio
async def test_vllm_tokenize_prompt(client: httpx.AsyncClient) -> None:
    body = await post(client, "/tokenize", {"model": "fake", "prompt": "hey", "return_token_strs": True})
    assert body == {"count": 3, "max_model_len": 2048, "tokens": [104, 101, 121], "token_strs": ["h", "e", "y"]}


@pytest.mark.asyncio
async def test_vllm_tokenize_messages_renders_the_chat(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = await post(client, "/tokenize", {"model": "fake", "messages": messages})
    text = bytes(body["tokens"]).decode()
    assert "hi" in text
    assert body["count"] == len(body["tokens"]) > 2
    short = await post(client, "/tokenize", {"model": "fake", "messages": messages, "add_generation_prompt": False})
    assert short["count"] < body["count"]


@pytest.mark.asyncio
async def test_detokenize_answers_both_anchors_keys(client: httpx.AsyncClient) -> None:
    assert await post(client, "/detokenize", {"tokens": [104, 105]}) == {"content": "hi", "prompt": "hi"}


@pytest.mark.asyncio
async def test_round_trip(client: httpx.AsyncClient) -> None:
    tokens = (await post(client, "/tokenize", {"content": "héllo wörld"}))["tokens"]
    assert (await post(client, "/detokenize", {"tokens": tokens}))["content"] == "héllo wörld"


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "a", "prompt": "b"}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"model": "nope", "content": "a"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])  # fmt: skip
async def test_bad_requests_are_4xx_naming_the_field(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert assert_openai_error(response.json())["param"] == param


@pytest.mark.asyncio
async def test_tokenizer_info_tells_what_a_remote_tokenizer_needs(client: httpx.AsyncClient) -> None:
    """lm-evaluation-harness's check for a server-side tokenizer: /tokenizer_info with `eos_token`, then /tokenize
    with vLLM's `prompt` answering `tokens`."""
    response = await client.get("/tokenizer_info")
    assert response.status_code == 200, response.text
    info = response.json()
    assert "eos_token" in info and info["model_max_length"] == 2048 and info["vocab_size"] == 257
    tokens = await post(client, "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert tokens["tokens"] == list(b"test")
    assert (await client.get("/tokenizer_info", params={"model": "nope"})).status_code == 404
