"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens, and their translators.

A body is parsed into a wire model (schemas.py) and translated once into a `ChatRequest`
(`to_chat_request`): `system` becomes the system message, content blocks become text with image placeholders,
`tool_use` blocks become the assistant's tool calls, `tool_result` blocks become tool messages, and earlier
thinking blocks the assistant turn's thinking (`Message.thinking`). The service's chunks are translated back into a
message (`message_body`) or the Messages stream (`message_events`): thinking blocks from `Chunk.reasoning`, text
blocks from `Chunk.text`, `tool_use` blocks from `Chunk.tool_calls`.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens that were not read from the cache, and
`cache_read_input_tokens` those that were (their sum is the prompt). The service reports a stop string only as
finish "stop"; which stop sequence ended a reply is found after the answer in the generated tokens
(`Generation.stop_string`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmserve.chat.media import MediaPolicy
from lmserve.dialects.anthropic import schemas as wire
from lmserve.dialects.anthropic.context import apply_edits
from lmserve.dialects.anthropic.output import (
    content_blocks,
    error_event,
    make_head,
    message_body,
    message_events,
    stop_reason,
)
from lmserve.dialects.anthropic.translate import image_sources, load_images, system_refusals, to_chat_request
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import MediaDep, ServiceDep
from lmserve.dialects.shared.streaming import GenerationResponse, guarded_errors, until_disconnect
from lmserve.service import Service
from lmserve.types import (
    ChatRequest,
    Usage,
)

# ---- routes ---------------------------------------------------------------------------------------


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


async def chat_request(service: Service, policy: MediaPolicy, body: wire.CountTokensRequest) -> ChatRequest:
    images = None
    if sources := image_sources(body):
        service.generation.check_images(body.model, len(sources))  # before fetching anything
        images = await load_images(body, policy)
    return to_chat_request(body, images)


async def edited_request(service: Service, policy: MediaPolicy,
                         body: wire.CountTokensRequest) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request with `context_management`'s edits applied, and the edits applied."""
    chat = await chat_request(service, policy, body)
    return await apply_edits(chat, body.context_management, service.generation.count_tokens)


@router.post("/messages", response_model=None)
async def messages(service: ServiceDep, policy: MediaDep, body: wire.MessagesRequest, request: Request) -> Response:
    with system_refusals(body):
        chat, edits = await edited_request(service, policy, body)
        generation = await service.generation.chat(chat)
    head = make_head(generation.model)
    extra = {} if body.context_management is None else {"context_management": {"applied_edits": edits}}
    if body.stream:
        frames = message_events(generation, head, extra)
        return GenerationResponse(generation, guarded_errors(frames, error_event))
    text, final = await until_disconnect(generation.collect(), request.receive)
    usage = final.usage or Usage(prompt_tokens=generation.num_prompt_tokens)
    reason = stop_reason(final, usage, generation.sampling.max_tokens)
    blocks = content_blocks(final.reasoning, text, final.tool_calls)
    return JSONResponse({**message_body(head, blocks, reason, final.stop_string, usage), **extra})


@router.post("/messages/count_tokens")
async def messages_count_tokens(service: ServiceDep, policy: MediaDep, body: wire.CountTokensRequest) -> dict[str, int]:
    with system_refusals(body):
        chat, _ = await edited_request(service, policy, body)
        return {"input_tokens": await service.generation.count_tokens(chat)}
