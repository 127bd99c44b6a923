"""POST /v1/decisions: OpenAI's Decisions API (the official client's `client.decisions.create`).

`input` (a text, or messages, function calls and custom tool calls with their outputs) is asked 1 to 400 typed
questions: a `predicate` (the probability that a statement holds), a `choice` (a probability per value; values are
typed, a string and a boolean with the same text are distinct) or a `score` (a probability per ordered level, the
first level's value 0; `score` is the expected value). Each probability is the model's own (service/judging.py);
`confidence` is the chosen value's (the likeliest level's) probability. `usage.input_tokens` counts every prompt token
the engine ran, and `cached_tokens` those it found computed (the input shared by the questions is computed once).
`prompt_cache_key`, `prompt_cache_options` and cache breakpoints are accepted: lmserve's prefix cache is automatic.
"""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from lmserve.chat.media import MediaPolicy, load_all, load_url
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import MediaDep, ServiceDep
from lmserve.dialects.shared.streaming import until_disconnect
from lmserve.errors import InvalidRequest
from lmserve.parsing import chat_role
from lmserve.service.judging import PREDICATE_ANSWERS, Decision, Judgment
from lmserve.types import IMAGE_PLACEHOLDER, PRIORITY_RANGE, Message, Question, ToolCall

_WIRE = ConfigDict(extra="allow")
MAX_JSON_BYTES = 256 * 1024
"""The most compact UTF-8 bytes an `input_json` part renders to (OpenAI's limit)."""


class TextPart(BaseModel):
    model_config = _WIRE
    type: Literal["input_text"]
    text: str


class ImagePart(BaseModel):
    model_config = _WIRE
    type: Literal["input_image"]
    image_url: str
    detail: str | None = None


class JsonPart(BaseModel):
    """A JSON object or array of objects, shown to the model as compact JSON text."""

    model_config = _WIRE
    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]]


class OutputTextPart(BaseModel):
    model_config = _WIRE
    type: Literal["output_text"]
    text: str


class RefusalPart(BaseModel):
    model_config = _WIRE
    type: Literal["refusal"]
    refusal: str


Part = Annotated[TextPart | ImagePart | JsonPart | OutputTextPart | RefusalPart, Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = _WIRE
    type: Literal["message"] = "message"
    role: Literal["user", "developer", "system", "assistant"]
    content: str | list[Part]


class CallItem(BaseModel):
    """A function call (`arguments`) or a custom tool call (`input`) the assistant made."""

    model_config = _WIRE
    type: Literal["function_call", "custom_tool_call"]
    call_id: str
    name: str
    arguments: str | None = None
    input: str | None = None


class CallOutputItem(BaseModel):
    model_config = _WIRE
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[Part]


InputItem = Annotated[MessageItem | CallItem | CallOutputItem, Field(union_mode="left_to_right")]


class ChoiceOption(BaseModel):
    model_config = _WIRE
    value: StrictStr | StrictBool
    description: str | None = None


class Level(BaseModel):
    model_config = _WIRE
    label: str
    description: str | None = None


class PredicateQuestion(BaseModel):
    model_config = _WIRE
    type: Literal["predicate"]
    instructions: str | list[Part]
    name: str | None = None


class ChoiceQuestion(BaseModel):
    model_config = _WIRE
    type: Literal["choice"]
    instructions: str | list[Part]
    choices: list[ChoiceOption]
    name: str | None = None


class ScoreQuestion(BaseModel):
    model_config = _WIRE
    type: Literal["score"]
    instructions: str | list[Part]
    levels: list[Level]
    name: str | None = None


QuestionBody = Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecisionRequest(BaseModel):
    """Body of POST /v1/decisions. `priority` (lmserve's, as for chat) orders it among other requests."""

    model_config = _WIRE
    model: str
    input: str | list[InputItem]
    questions: list[QuestionBody]
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    priority: int = Field(default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])


ImageRef = tuple[str, str]
"""(where it is in the request, its URL)."""


def parts_text(content: str | list[Part], where: str) -> tuple[str, list[ImageRef]]:
    """Text parts in order (a blank line between two), JSON parts as compact JSON, each image an
    IMAGE_PLACEHOLDER where it stood."""
    if isinstance(content, str):
        return content, []
    out = ""
    refs: list[ImageRef] = []
    previous_is_text = False
    for j, part in enumerate(content):
        if isinstance(part, ImagePart):
            out += IMAGE_PLACEHOLDER
            refs.append((f"{where}[{j}].image_url", part.image_url))
            previous_is_text = False
            continue
        if isinstance(part, JsonPart):
            text = json.dumps(part.data, ensure_ascii=False, separators=(",", ":"))
            if len(text.encode("utf-8")) > MAX_JSON_BYTES:
                raise InvalidRequest(f"{where}[{j}]: input_json is more than {MAX_JSON_BYTES} bytes of compact JSON",
                                     param="input")
        else:
            text = part.refusal if isinstance(part, RefusalPart) else part.text
        out += ("\n\n" if previous_is_text else "") + text
        previous_is_text = True
    return out, refs


def to_messages(raw: str | list[InputItem]) -> tuple[list[Message], list[list[ImageRef]]]:
    """The input as chat messages and each message's images. A call joins the assistant turn before it; an output
    is a `tool` message and must answer an earlier call (by call_id)."""
    if isinstance(raw, str):
        return [Message("user", raw)], [[]]
    messages: list[Message] = []
    images: list[list[ImageRef]] = []
    calls: dict[str, str] = {}
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            text, refs = parts_text(item.content, f"{where}.content")
            messages.append(Message(chat_role(item.role), text))
            images.append(refs)
        elif isinstance(item, CallItem):
            calls[item.call_id] = item.name
            arguments = item.arguments if item.type == "function_call" else json.dumps({"input": item.input or ""})
            call = ToolCall(item.name, arguments or "{}", item.call_id)
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls.append(call)
            else:
                messages.append(Message("assistant", "", tool_calls=[call]))
                images.append([])
        else:
            if item.call_id not in calls:
                raise InvalidRequest(f"{where}: call_id {item.call_id!r} answers no earlier call in input",
                                     param=f"{where}.call_id")
            text, refs = parts_text(item.output, f"{where}.output")
            messages.append(Message("tool", text, tool_call_id=item.call_id, name=calls[item.call_id]))
            images.append(refs)
    return messages, images


def to_question(body: QuestionBody, where: str) -> tuple[Question, list[ImageRef]]:
    """A question record (its images still to load), with the texts the model answers with."""
    text, refs = parts_text(body.instructions, f"{where}.instructions")
    if isinstance(body, PredicateQuestion):
        return Question("predicate", text, list(PREDICATE_ANSWERS), name=body.name), refs
    if isinstance(body, ChoiceQuestion):
        values = [(type(c.value), c.value) for c in body.choices]
        if len(set(values)) != len(values):
            raise InvalidRequest(f"{where}: each choice must be unique", param=f"{where}.choices")
        return Question("choice", text, [_value_text(c.value) for c in body.choices],
                        [c.description or "" for c in body.choices], name=body.name), refs
    return Question("score", text, [level.label for level in body.levels],
                    [level.description or "" for level in body.levels], name=body.name), refs


def _value_text(value: str | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else value


def answer_body(body: QuestionBody, judgment: Judgment) -> dict[str, Any]:
    """One answer on the wire, for its question's kind."""
    probabilities = judgment.probabilities
    best = max(range(len(probabilities)), key=probabilities.__getitem__)
    if isinstance(body, PredicateQuestion):
        return {"type": "predicate", "name": body.name, "probability": probabilities[0]}
    if isinstance(body, ChoiceQuestion):
        return {"type": "choice", "name": body.name, "choice": body.choices[best].value,
                "confidence": probabilities[best],
                "probabilities": [{"value": c.value, "probability": p}
                                  for c, p in zip(body.choices, probabilities, strict=True)]}
    return {"type": "score", "name": body.name, "score": sum(i * p for i, p in enumerate(probabilities)),
            "confidence": probabilities[best],
            "probabilities": [{"label": level.label, "value": i, "probability": p}
                              for i, (level, p) in enumerate(zip(body.levels, probabilities, strict=True))]}


def decision_body(body: DecisionRequest, decision: Decision) -> dict[str, Any]:
    usage = decision.usage
    return {
        "answers": [answer_body(q, j) for q, j in zip(body.questions, decision.judgments, strict=True)],
        "model": decision.model,
        "usage": {"input_tokens": usage.prompt_tokens,
                  "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                  "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage.prompt_tokens},
    }


async def _images(groups: list[list[ImageRef]], policy: MediaPolicy) -> list[list[bytes]]:
    loads: list[list[tuple[str, Coroutine[Any, Any, bytes]]]] = [
        [(where, load_url(url, policy)) for where, url in group] for group in groups]
    return await load_all(loads, param="input")


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


@router.post("/decisions")
async def decisions(service: ServiceDep, policy: MediaDep, body: DecisionRequest, request: Request) -> dict[str, Any]:
    messages, message_refs = to_messages(body.input)
    asked = [to_question(q, f"questions[{i}]") for i, q in enumerate(body.questions)]
    questions = [q for q, _ in asked]
    refs = message_refs + [r for _, r in asked]
    if any(refs):
        service.generation.check_images(body.model, sum(map(len, refs)), param="input")
        loaded = await _images(refs, policy)
        for message, images in zip(messages, loaded, strict=False):
            message.images = images
        for question, images in zip(questions, loaded[len(messages):], strict=True):
            question.images = images
    work = service.judging.decide(body.model, messages, questions, priority=body.priority)
    return decision_body(body, await until_disconnect(work, request.receive))
