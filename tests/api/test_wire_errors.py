"""Error texts a client sees: the field as the client wrote it, what is supported, and what exists."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from api_wire import assert_openai_error

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

CHAT = "/v1/chat/completions"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields}


def user_parts(*parts: dict[str, Any]) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (chat(response_format={"type": "json_schema"}), "response_format",
         "Missing required parameter: 'response_format.json_schema'."),
        (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format",
         "Missing required parameter: 'response_format.json_schema.schema'."),  # name is optional (llama-server)
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
         "Missing required parameter: 'response_format.json_schema.schema'."),
        (chat(response_format={"type": "yaml"}), "response_format",
         "Invalid value for 'response_format': type 'yaml' is not supported; use 'text', 'json_object' or "
         "'json_schema'"),
        (user_parts({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}),
         "messages[0].content[1].input_audio",
         "messages[0].content[1].input_audio: not a readable audio file (wav, flac, ogg, mp3): Format not recognised."),
        (user_parts({"type": "input_audio", "input_audio": {"data": "AA=="}}), "messages",
         "Missing required parameter: 'messages[0].content[1].input_audio.format'."),
        (user_parts({"type": "foo"}), "messages",
         "Invalid value for 'messages[0].content[1]': content part type 'foo' is not supported; "
         "use 'text', 'image_url', 'input_audio', 'audio_url' or 'refusal'"),
        (user_parts({"type": "audio_url", "audio_url": {"url": "ftp://example.org/a.wav"}}), "messages",
         "messages[0].content[1].audio_url.url: an audio clip must be an http(s) URL or a data: URI (other schemes "
         "are refused)"),
        (user_parts({"text": "no type"}), "messages", "Missing required parameter: 'messages[0].content[1].type'."),
        (user_parts({"type": "image_url"}), "messages",
         "Missing required parameter: 'messages[0].content[1].image_url'."),
        (user_parts({"type": "text"}), "messages", "Missing required parameter: 'messages[0].content[1].text'."),
        (chat(tool_choice={"type": "function"}), "tool_choice", "Missing required parameter: 'tool_choice.function'."),
        (chat(messages=[{"role": "user"}]), "messages",
         "Invalid value for 'messages[0]': a user message must have content"),
    ],
)  # fmt: skip
async def test_openai_400s_name_the_field_as_written(
    client: httpx.AsyncClient, body: dict[str, Any], param: str, message: str
) -> None:
    response = await client.post(CHAT, json=body)
    assert response.status_code == 400
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert (error["param"], error["message"]) == (param, message)


NOT_FOUND = "model 'gpt-4o' not found (available: fake)"


@pytest.mark.parametrize(
    ("method", "path", "body", "shape"),
    [
        ("POST", CHAT, chat(model="gpt-4o"), "openai"),
        ("POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, "openai"),
        ("GET", "/v1/models/gpt-4o", None, "openai"),
        ("POST", "/api/chat", chat(model="gpt-4o"), "native"),
        ("POST", "/api/generate", {"model": "gpt-4o", "prompt": "hi"}, "native"),
        ("POST", "/api/show", {"model": "gpt-4o"}, "native"),
    ],
)  # fmt: skip
async def test_an_unknown_model_is_named_as_written_with_what_exists(
    client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None, shape: str
) -> None:
    response = await client.request(method, path, json=body)
    assert response.status_code == 404
    if shape == "native":
        assert response.json() == {"error": NOT_FOUND}
    else:
        error = assert_openai_error(response.json(), error_type="not_found_error")
        assert (error["message"], error["param"], error["code"]) == (NOT_FOUND, "model", "model_not_found")


# ---- a prompt longer than the context -------------------------------------------------------------------------------

CLAUDE_CODE_PATTERN = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)")
"""How Claude Code reads the numbers of a prompt that is too long (it then compacts the conversation)."""
OVER = re.compile(r"^The prompt has (\d+) tokens, but this model's context is 256 tokens per sequence")


@pytest_asyncio.fixture
async def trained_client() -> AsyncIterator[httpx.AsyncClient]:
    """A fake model served with a 256-token context, trained for 1024."""
    engine = BatchingEngine(FakeBackend(num_ctx=256, num_parallel=1, num_ctx_train=1024))
    service = static_service([LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))])
    transport = httpx.ASGITransport(create_app(service, ServerConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    engine.close()


def overflow_message(path: str, body: dict[str, Any]) -> str:
    """The message of a context overflow in the dialect of `path`, its shape checked."""
    if path == "/api/chat":
        assert set(body) == {"error"}
        return str(body["error"])
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        message = str(body["error"]["message"])
        found = CLAUDE_CODE_PATTERN.match(message)
        assert found is not None, message
        prompt = OVER.search(message.split(". ", 1)[1])
        assert prompt is not None and found.groups() == (prompt.group(1), "256")
        return message.split(". ", 1)[1]
    error = assert_openai_error(body, error_type="invalid_request_error")
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    return str(error["message"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages"])
@pytest.mark.parametrize(
    ("length", "advice"),
    [
        (400, "This model was trained for up to 1024 tokens: start the server with -c 512 (--ctx-size), or set "
         "num_ctx 512 in the request's options or a Modelfile PARAMETER; or shorten the prompt."),
        (2000, "This model was trained for at most 1024 tokens, so it cannot take this prompt: shorten it, or use a "
         "model with a longer context."),
    ],
)
async def test_a_prompt_over_the_context_is_a_400_with_advice_in_each_dialect(
    trained_client: httpx.AsyncClient, path: str, length: int, advice: str
) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "x" * length}], "stream": False,
            "max_tokens": 32000}
    response = await trained_client.post(path, json=body)
    assert response.status_code == 400
    message = overflow_message(path, response.json())
    assert OVER.match(message) and message.endswith(advice), message
