"""Reranking, scoring and classifying over the judging service (service/judging.py).

- `POST /v1/rerank`, `/rerank`, `/v2/rerank`: the Cohere / Jina / llama-server body (`query`, `documents` as texts or
  objects, `top_n`, `return_documents`); results most relevant first, each `{index, relevance_score, document?}`.
  An object document is its `text` field, else its fields as `key: value` lines (Cohere's advice for structured data).
- `POST /v1/score`, `/score`: vLLM's pairwise form (`text_1` and `text_2`, a text or texts each: one against many, or
  pairs in order); `data` is `[{index, object: "score", score}]` in the pairs' order.
- `POST /v1/classify`: Cohere's classify (`inputs` and labelled `examples`): a choice among the examples' labels for
  each input, the examples shown to the model first; `labels` holds every label's probability (they sum to 1).
- `POST /api/rerank`: the native dialect's (`model`, `query`, `documents`, `top_n`, `keep_alive`, `options`).

`relevance_score` is 0 to 1: a dedicated reranker's score through a sigmoid, else the chat model's probability that
the document is relevant (Yes, renormalized over Yes and No).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from lmserve.dialects.native.schemas import KeepAlive
from lmserve.dialects.native.translate import parse_keep_alive
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import ServiceDep
from lmserve.dialects.shared.streaming import until_disconnect
from lmserve.endpoints.tokens import default_model
from lmserve.errors import InvalidRequest
from lmserve.options import from_native
from lmserve.service import Service
from lmserve.service.judging import Ranking
from lmserve.types import Message, Question, RequestOptions

_WIRE = ConfigDict(extra="allow")


class RerankRequest(BaseModel):
    """Body of the rerank routes (Cohere v1/v2, Jina, llama-server, the native /api/rerank)."""

    model_config = _WIRE
    model: str | None = None
    query: str
    documents: list[StrictStr | dict[str, Any]]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    truncate: bool = True
    keep_alive: KeepAlive = None
    options: dict[str, Any] | None = None


class ScoreRequest(BaseModel):
    """Body of /v1/score (vLLM's): `text_1` against `text_2`, one against many or pairs in order."""

    model_config = _WIRE
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class Example(BaseModel):
    model_config = _WIRE
    text: str
    label: str


class ClassifyRequest(BaseModel):
    """Body of /v1/classify (Cohere's)."""

    model_config = _WIRE
    model: str | None = None
    inputs: list[str] = Field(min_length=1, max_length=96)
    examples: list[Example] = Field(min_length=1)
    truncate: str | None = None


def document_text(document: str | dict[str, Any]) -> str:
    """A document as the text the model reads: a string as it is, an object's `text`, else its fields as lines."""
    if isinstance(document, str):
        return document
    text = document.get("text")
    if isinstance(text, str):
        return text
    return "\n".join(f"{key}: {value}" for key, value in document.items())


def ranked_results(ranking: Ranking, documents: list[str], top_n: int | None, with_documents: bool) -> list[Any]:
    """The results most relevant first (ties keep the documents' order), cut to `top_n`."""
    order = sorted(range(len(documents)), key=lambda i: -ranking.scores[i])[: top_n or len(documents)]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": ranking.scores[i]}
        if with_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return results


def score_pairs(body: ScoreRequest) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs of a score request: one text against each of many, or lists paired in order."""
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first or not second:
        raise InvalidRequest("text_1 and text_2 must not be empty", param="text_1" if not first else "text_2")
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise InvalidRequest(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                             "as text_2", param="text_2")
    return list(zip(first, second, strict=True))


def examples_prompt(examples: list[Example], text: str) -> list[Message]:
    """The input a chat model classifies `text` in: the labelled examples first (shared by every input)."""
    shown = "\n".join(f"Text: {e.text}\nLabel: {e.label}\n" for e in examples)
    return [Message("user", f"Labelled examples:\n\n{shown}\nText: {text}")]


router = APIRouter(route_class=JsonBodyRoute)


async def rank(service: Service, body: RerankRequest, request: Request) -> tuple[Ranking, list[str]]:
    """The ranking on every route: `options` (load-time ones such as num_ctx) and `keep_alive` as natively."""
    documents = [document_text(d) for d in body.documents]
    options = RequestOptions(from_native(body.options or {}), "native")
    work = service.judging.rerank(default_model(service, body.model), body.query, documents, options=options,
                                  keep_alive=parse_keep_alive(body.keep_alive), truncate=body.truncate)
    return await until_disconnect(work, request.receive), documents


async def openai_rerank(service: ServiceDep, body: RerankRequest, request: Request) -> dict[str, Any]:
    ranking, documents = await rank(service, body, request)
    usage = {"prompt_tokens": ranking.usage.prompt_tokens, "total_tokens": ranking.usage.prompt_tokens}
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": ranking.model,
            "results": ranked_results(ranking, documents, body.top_n, body.return_documents), "usage": usage,
            "meta": {"api_version": {"version": "2"},
                     "billed_units": {"input_tokens": ranking.usage.prompt_tokens}}}


for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
    router.add_api_route(path, openai_rerank, methods=["POST"], name=f"rerank {path}")


async def score(service: ServiceDep, body: ScoreRequest, request: Request) -> dict[str, Any]:
    if body.truncate_prompt_tokens is not None:
        raise InvalidRequest("truncate_prompt_tokens is not supported: pairs longer than the context are cut "
                             "to it (dedicated rerankers) or refused", param="truncate_prompt_tokens")
    pairs = score_pairs(body)
    model = default_model(service, body.model)
    scores: list[float] = [0.0] * len(pairs)
    num_tokens, name = 0, model
    for query in dict.fromkeys(q for q, _ in pairs):  # one ranking per distinct text_1
        indices = [i for i, (q, _) in enumerate(pairs) if q == query]
        work = service.judging.rerank(model, query, [pairs[i][1] for i in indices])
        ranking = await until_disconnect(work, request.receive)
        for i, value in zip(indices, ranking.scores, strict=True):
            scores[i] = value
        num_tokens, name = num_tokens + ranking.usage.prompt_tokens, ranking.model
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}


for path in ("/v1/score", "/score"):
    router.add_api_route(path, score, methods=["POST"], name=f"score {path}")


@router.post("/v1/classify")
async def classify(service: ServiceDep, body: ClassifyRequest, request: Request) -> dict[str, Any]:
    if body.truncate not in (None, "NONE", "END"):
        raise InvalidRequest("truncate: only NONE and END are supported (a long input is refused, or cut at its "
                             "end by the context)", param="truncate")
    labels = list(dict.fromkeys(e.label for e in body.examples))
    if len(labels) < 2:
        raise InvalidRequest("examples must carry at least two different labels", param="examples")
    question = Question("choice", "Which label fits the last text?", labels)
    cases = [(examples_prompt(body.examples, text), question) for text in body.inputs]
    work = service.judging.judge(default_model(service, body.model), cases)
    decision = await until_disconnect(work, request.receive)
    results = []
    for text, judgment in zip(body.inputs, decision.judgments, strict=True):
        probabilities = judgment.probabilities
        best = max(range(len(labels)), key=probabilities.__getitem__)
        confidences = {label: {"confidence": p} for label, p in zip(labels, probabilities, strict=True)}
        results.append({"id": uuid.uuid4().hex, "input": text, "prediction": labels[best],
                        "predictions": [labels[best]], "confidence": probabilities[best],
                        "confidences": [probabilities[best]], "labels": confidences,
                        "classification_type": "single-label"})
    return {"id": uuid.uuid4().hex, "classifications": results, "meta": {"api_version": {"version": "1"}}}


@router.post("/api/rerank")
async def native_rerank(service: ServiceDep, body: RerankRequest, request: Request) -> dict[str, Any]:
    ranking, documents = await rank(service, body, request)
    return {"model": ranking.model, "results": ranked_results(ranking, documents, body.top_n, True),
            "prompt_eval_count": ranking.usage.prompt_tokens}
