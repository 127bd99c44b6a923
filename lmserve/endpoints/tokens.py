"""POST /tokenize and /detokenize, in llama-server's shapes and vLLM's, on the same routes; GET /tokenizer_info
in vLLM's.

llama-server: `{content, add_special=false, with_pieces=false}` → `{tokens: [id…]}`, or with pieces
`{tokens: [{id, piece}…]}` (a piece is a string, or its bytes as a list of numbers when they are not valid UTF-8);
`{tokens}` → `{content}`. vLLM: `{model, prompt, add_special_tokens=true, return_token_strs}` or `{model, messages,
add_generation_prompt=true, add_special_tokens=false, tools, chat_template_kwargs}` (the chat rendered with the
model's template) → `{count, max_model_len, tokens, token_strs}`; `{model, tokens}` → `{prompt}`. A request is
read as vLLM's when it has `prompt` or `messages`, as llama-server's when it has `content`; /detokenize answers
both keys (`content` and `prompt`). Neither anchor has `/v1/` twins. Without `model`, the model is the only one
loaded (or the only one there is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.translate import to_chat_request
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import ServiceDep
from lmserve.errors import InvalidRequest
from lmserve.service import Service
from lmserve.service.residency import LoadedModel

T = TypeVar("T")

_WIRE = ConfigDict(extra="allow")


class TokenizeBody(BaseModel):
    """Body of POST /tokenize: llama-server's (`content`) or vLLM's (`prompt` or `messages`)."""

    model_config = _WIRE
    model: str | None = None
    content: str | None = None
    """llama-server: the text to tokenize."""
    add_special: bool = False
    """llama-server: add the vocabulary's special tokens (BOS)."""
    with_pieces: bool = False
    """llama-server: each token with its text (`piece`)."""
    prompt: str | None = None
    """vLLM: the text to tokenize."""
    messages: list[schemas.ChatMessage] | None = Field(default=None, min_length=1)
    """vLLM: a chat, rendered with the model's template, to tokenize."""
    add_special_tokens: bool | None = None
    """vLLM: add special tokens (default: true for `prompt`, false for `messages`)."""
    add_generation_prompt: bool = True
    tools: list[schemas.Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    """vLLM: also each token's text (`token_strs`)."""


class DetokenizeBody(BaseModel):
    """Body of POST /detokenize (both anchors' shape)."""

    model_config = _WIRE
    model: str | None = None
    tokens: list[int]


def default_model(service: Service, name: str | None) -> str:
    """`name`, else the only loaded model, else the only model there is; a 400 when that is ambiguous."""
    if name:
        return name
    loaded = sorted({resident.model.name for resident in service.models.running()})
    if len(loaded) == 1:
        return loaded[0]
    listed = [listing.name for listing in service.models.listing()]
    if len(listed) == 1:
        return listed[0]
    raise InvalidRequest(f"model is required: {len(loaded) or len(listed)} models could answer", param="model")


async def with_model(service: Service, name: str | None, work: Callable[[LoadedModel], T]) -> T:
    """`work` on the model (loaded if need be), holding it for the call."""
    resident = await service.generation.acquire(default_model(service, name))
    try:
        return work(resident.model)
    finally:
        service.residency.release(resident)


def piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes when they are not valid UTF-8 (llama-server's `piece`)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def check_ids(model: LoadedModel, tokens: list[int]) -> None:
    """A 400 naming the first id that is not in the model's vocabulary."""
    size = model.engine.info.num_vocab
    for i, token in enumerate(tokens):
        if not 0 <= token < size:
            raise InvalidRequest(f"tokens[{i}] = {token} is not a token id of this model (0 to {size - 1})",
                                 param="tokens")


def llama_tokenize(model: LoadedModel, body: TokenizeBody) -> dict[str, Any]:
    """llama-server's answer: ids, or ids with their pieces."""
    assert body.content is not None
    ids = model.engine.tokenize(body.content, add_special=body.add_special, parse_special=True)
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": piece(model.engine.token_bytes(token))} for token in ids]}


def vllm_tokenize(service: Service, model: LoadedModel, body: TokenizeBody) -> dict[str, Any]:
    """vLLM's answer: ids, their count and the context length (and each token's text when asked)."""
    if body.messages is not None:
        chat = schemas.ChatCompletionRequest(model=model.name, messages=body.messages, tools=body.tools,
                                             chat_template_kwargs=body.chat_template_kwargs)
        request = to_chat_request(chat, add_generation_prompt=body.add_generation_prompt)
        text = service.generation.render_chat(model, request)
        add_special = bool(body.add_special_tokens)
    else:
        assert body.prompt is not None
        text = body.prompt
        add_special = body.add_special_tokens is not False
    ids = model.engine.tokenize(text, add_special=add_special, parse_special=True)
    strs = [model.engine.token_bytes(token).decode("utf-8", "replace") for token in ids] if body.return_token_strs \
        else None
    return {"count": len(ids), "max_model_len": model.engine.info.num_ctx, "tokens": ids, "token_strs": strs}


def describe_tokenizer(model: LoadedModel) -> dict[str, Any]:
    """GET /tokenizer_info's answer, in vLLM's field names (a special token as its text; none: null)."""
    info = model.engine.info
    return {"tokenizer_class": f"{info.engine}:{model.name}", "bos_token": info.bos_token or None,
            "eos_token": info.eos_token or None, "pad_token": None, "unk_token": None,
            "model_max_length": info.num_ctx, "chat_template": model.template_source or info.chat_template,
            "vocab_size": info.num_vocab}


router = APIRouter(route_class=JsonBodyRoute)


@router.post("/tokenize")
async def tokenize(service: ServiceDep, body: TokenizeBody) -> dict[str, Any]:
    forms = [name for name in ("content", "prompt", "messages") if getattr(body, name) is not None]
    if len(forms) != 1:
        raise InvalidRequest("send one of content (llama-server's form), prompt or messages (vLLM's)",
                             param="content")
    if body.content is not None:
        return await with_model(service, body.model, lambda model: llama_tokenize(model, body))
    return await with_model(service, body.model, lambda model: vllm_tokenize(service, model, body))


@router.get("/tokenizer_info")
async def tokenizer_info(service: ServiceDep, model: str | None = None) -> dict[str, Any]:
    """vLLM's tokenizer description; lm-evaluation-harness reads it to tokenize through /tokenize and
    /detokenize (its remote tokenizer) instead of fetching the tokenizer from a hub."""
    return await with_model(service, model, describe_tokenizer)


@router.post("/detokenize")
async def detokenize(service: ServiceDep, body: DetokenizeBody) -> dict[str, Any]:

    def text(model: LoadedModel) -> str:
        check_ids(model, body.tokens)
        return b"".join(model.engine.token_bytes(token) for token in body.tokens).decode("utf-8", "replace")

    content = await with_model(service, body.model, text)
    return {"content": content, "prompt": content}
