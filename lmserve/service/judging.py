"""Judging: exact probabilities of a model's answers to typed questions (the Decisions API, reranking, classifying).

A question is asked as a chat turn after its input, and its answers are the texts the model may reply with. The
probability of an answer is the model's own: the chain rule over the answer's tokens, each log P(token | prompt and
the answer's earlier tokens) read from the next-token distribution (`SamplingParams.score_tokens`: a log-softmax of
the raw logits), then renormalized over the question's answers. Where one answer's tokens begin another's, each such
answer is followed by the end-of-turn token, so the answers stay disjoint events ("exactly this", not "this and
maybe more"). Answers are scored as their canonical tokenization; other spellings of the same text by the model
are not counted.

Every question's prompt begins with the same tokens (the input); they are computed once and shared by every
question (the engine's prefix sharing, a snapshot at their end for a model whose memory cannot be cut). A question's
turn then opens with how to answer it (`question_header`), which questions with the same answers share too, so each
question costs its own instructions and one step. Each question is computed the same way wherever it runs (see
`JudgingService.judge`), so its answer does not depend on the other questions asked with it.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace

from lmserve.engine.protocol import Engine, GenerationStream, PromptImage
from lmserve.errors import ContextOverflow, EngineFailure, InvalidRequest, Overloaded
from lmserve.service.catalog import ModelSettings
from lmserve.service.generation import GenerationService
from lmserve.service.residency import LoadedModel
from lmserve.types import (
    MAX_SCORE_TOKENS,
    ChatRequest,
    Chunk,
    Message,
    Question,
    RequestOptions,
    SamplingParams,
    Usage,
)

MAX_QUESTIONS = 400
"""The most questions one decision asks (OpenAI's limit)."""
MAX_CHOICES = 255
"""The most answers a choice question offers (OpenAI's limit; at least 2)."""
MAX_LEVELS = 10
"""The most levels of a score question (at least 2)."""
PREDICATE_ANSWERS = ("Yes", "No")
"""What a predicate is answered with; its probability is the first's."""
_WINDOW = 64
"""The most scoring sequences one decision keeps in the engine at once (the rest wait their turn here)."""
_OVERLOAD_WAIT = 30.0
"""Seconds a scoring sequence waits for room in a full engine queue before the decision fails with a 503."""
_OVERLOAD_POLL = 0.05
_PROBE = "?"
"""A question text unlike any other's opening: where a prompt asking it leaves a question's, the input ends; where
one asking a question's opening and then it leaves the question's, the opening ends."""
_MIN_PRIME = 16
"""Inputs of at least this many tokens are computed on their own before the questions that follow them, so a
question's answer never depends on which others came with it (see `JudgingService.judge`)."""
_MIN_HEADER = 4
"""A question's opening of at least this many tokens is a stretch of its own, computed once for the questions that
share it (see `JudgingService.judge`)."""


@dataclass(slots=True)
class Judgment:
    """One question's answer: the probability of each of its answers, in order, summing to 1."""

    probabilities: list[float]


@dataclass(slots=True)
class Decision:
    """The answers to a decision's questions, in order, and the tokens the engine ran (`prompt_tokens`, of them
    `cached_tokens` found computed: the shared input is computed once)."""

    model: str
    judgments: list[Judgment]
    usage: Usage = field(default_factory=Usage)


def check_questions(questions: list[Question]) -> None:
    """InvalidRequest (param "questions") unless there are 1..MAX_QUESTIONS questions, each one sound."""
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise InvalidRequest(f"ask between 1 and {MAX_QUESTIONS} questions ({len(questions)} given)", param="questions")
    for i, q in enumerate(questions):
        check_question(q, f"questions[{i}]")


def check_question(q: Question, where: str) -> None:
    """InvalidRequest unless `q` has instructions and distinct, non-empty answers within its kind's limits."""
    low, high = {"predicate": (2, 2), "choice": (2, MAX_CHOICES), "score": (2, MAX_LEVELS)}[q.kind]
    what = "levels" if q.kind == "score" else "choices"
    if not low <= len(q.answers) <= high:
        raise InvalidRequest(f"{where}: give between {low} and {high} {what} ({len(q.answers)} given)",
                             param=f"{where}.{what}")
    if any(not a.strip() for a in q.answers):
        raise InvalidRequest(f"{where}: every one of the {what} needs a non-empty text", param=f"{where}.{what}")
    if len(set(q.answers)) != len(q.answers):
        raise InvalidRequest(f"{where}: the {what} must be distinct (the model answers with their text)",
                             param=f"{where}.{what}")
    if not q.instructions.strip() and not q.images:
        raise InvalidRequest(f"{where}: instructions must not be empty", param=f"{where}.instructions")


def question_header(q: Question) -> str:
    """The opening of a question's turn: how to answer it (its answers, in few tokens). Questions with the same
    answers open alike, so after one input that opening is computed once for all of them (see
    `JudgingService.judge`) and each question costs only its own instructions."""
    if q.kind == "predicate":
        return "Say whether the statement is true. Answer Yes or No."
    scale = " from lowest to highest" if q.kind == "score" else ""
    descriptions = _descriptions(q)
    if any(descriptions):
        lines = "\n".join(f"- {a}: {d}" if d else f"- {a}" for a, d in zip(q.answers, descriptions, strict=True))
        return f"Answer with one of these{scale}:\n{lines}"
    return f"Answer with one of{scale}: {', '.join(q.answers)}."


def question_text(q: Question) -> str:
    """How a question is put to the model after its input: how to answer (`question_header`), then the question."""
    body = f"Statement: {q.instructions}" if q.kind == "predicate" else q.instructions
    return f"{question_header(q)}\n{body}"


def _descriptions(q: Question) -> list[str]:
    return list(q.descriptions) + [""] * (len(q.answers) - len(q.descriptions))


def asked(messages: list[Message], text: str, images: list[bytes] | None = None) -> list[Message]:
    """The conversation that asks `text` (a question, with its `images`) about `messages`: it joins the last user
    turn (after a blank line), or follows as a user turn of its own after any other."""
    images = images or []
    if messages and messages[-1].role == "user":
        last = messages[-1]
        content = f"{last.content}\n\n{text}" if last.content else text
        return [*messages[:-1], replace(last, content=content, images=[*last.images, *images])]
    return [*messages, Message("user", text, images=list(images))]


@dataclass(slots=True)
class _Node:
    """A place where the next-token distribution is read: the question's prompt and some of an answer's tokens."""

    prompt: list[int]
    tokens: list[int]
    """The tokens whose log-probabilities are read there."""
    scores: dict[int, float] = field(default_factory=dict)


def answer_tokens(engine: Engine, answers: list[str], end: int | None) -> list[list[int]]:
    """Each answer's tokens; an answer whose tokens begin another's is followed by the end token `end`."""
    spelled = [engine.tokenize(a, add_special=False, parse_special=False) for a in answers]
    if any(not tokens for tokens in spelled):
        raise InvalidRequest("an answer has no tokens", param="questions")
    out = []
    for i, tokens in enumerate(spelled):
        is_prefix = any(j != i and len(other) > len(tokens) and other[: len(tokens)] == tokens
                        for j, other in enumerate(spelled))
        if is_prefix or any(j != i and other == tokens for j, other in enumerate(spelled)):
            if end is None or any(j != i and other == tokens for j, other in enumerate(spelled)):
                raise InvalidRequest(f"the answers {answers[i]!r} and another tokenize alike; they cannot be told "
                                     "apart", param="questions")
            tokens = [*tokens, end]
        out.append(tokens)
    return out


def plan_nodes(prompt: list[int], answers: list[list[int]]) -> dict[tuple[int, ...], _Node]:
    """The places each answer's tokens are read, keyed by the answer tokens before them (shared answers' beginnings
    are read once)."""
    nodes: dict[tuple[int, ...], _Node] = {}
    for tokens in answers:
        for k, token in enumerate(tokens):
            key = tuple(tokens[:k])
            node = nodes.setdefault(key, _Node(prompt + list(key), []))
            if token not in node.tokens:
                node.tokens.append(token)
    return nodes


def renormalized(log_probs: list[float]) -> list[float]:
    """Probabilities proportional to exp(`log_probs`), summing to 1 (uniform if every answer is impossible)."""
    peak = max(log_probs)
    if not math.isfinite(peak):
        return [1.0 / len(log_probs)] * len(log_probs)
    weights = [math.exp(v - peak) for v in log_probs]
    total = math.fsum(weights)
    return [w / total for w in weights]


RELEVANCE = "The document is relevant to the query: it answers the query, or helps to answer it."
"""The predicate a chat model reranks by (the probability of Yes is the document's relevance score)."""


@dataclass(slots=True)
class Ranking:
    """Each document's relevance to a query, 0 to 1 (higher is more relevant), in the documents' order."""

    model: str
    scores: list[float]
    usage: Usage = field(default_factory=Usage)


def relevance_input(query: str, document: str) -> list[Message]:
    """The input a chat model judges a document's relevance to a query in (the query first: it is shared)."""
    return [Message("user", f"Query: {query}\n\nDocument: {document}")]


class JudgingService:
    """Answers decisions: typed questions about an input, each answer's probability exact (see the module); and
    reranks documents, with a dedicated reranker or any chat model judging relevance."""

    def __init__(self, generation: GenerationService) -> None:
        self.generation = generation

    async def decide(self, model_name: str, messages: list[Message], questions: list[Question], *,
                     options: RequestOptions | None = None, keep_alive: float | None = None,
                     priority: int = 0) -> Decision:
        """The probabilities of every question's answers about `messages` (see the module for how)."""
        check_questions(questions)
        if not messages:
            raise InvalidRequest("input must not be empty", param="input")
        num_images = sum(len(m.images) for m in messages) + sum(len(q.images) for q in questions)
        if num_images:
            self.generation.check_images(model_name, num_images, param="input")
        return await self.judge(model_name, [(messages, q) for q in questions], options, keep_alive, priority,
                                share_openings=True)

    async def rerank(self, model_name: str, query: str, documents: list[str], *, options: RequestOptions | None = None,
                     keep_alive: float | None = None, truncate: bool = True) -> Ranking:
        """Each document's relevance to `query`: a dedicated reranker's score through a sigmoid, or a chat model's
        probability that RELEVANCE holds (Yes, renormalized over Yes and No)."""
        if not query.strip():
            raise InvalidRequest("query must not be empty", param="query")
        if not documents:
            raise InvalidRequest("documents must not be empty", param="documents")
        if len(documents) > MAX_QUESTIONS * 10:
            raise InvalidRequest(f"at most {MAX_QUESTIONS * 10} documents can be ranked at once", param="documents")
        options = options or RequestOptions()
        gen = self.generation
        resident = await gen.acquire(model_name, options, keep_alive)
        try:
            engine = resident.model.engine
            if engine.info.can_rank:
                logits = await engine.rank(query, documents, truncate=truncate)
                num_tokens = sum(len(engine.tokenize(query + d, add_special=False)) for d in documents)
                usage = Usage(prompt_tokens=num_tokens)
                gen.observers.finished(resident.model.name, Chunk(finish_reason="stop", usage=usage))
                return Ranking(resident.model.name, [_sigmoid(x) for x in logits], usage)
        finally:
            gen.residency.release(resident)
        relevant = Question("predicate", RELEVANCE, list(PREDICATE_ANSWERS))
        decision = await self.judge(model_name, [(relevance_input(query, d), relevant) for d in documents], options,
                                    keep_alive)
        return Ranking(decision.model, [j.probabilities[0] for j in decision.judgments], decision.usage)

    async def judge(self, model_name: str, cases: list[tuple[list[Message], Question]],
                    options: RequestOptions | None = None, keep_alive: float | None = None,
                    priority: int = 0, *, share_openings: bool = False) -> Decision:
        """Each case's question asked about its own input, on one lease of the model; the prompts' common beginning
        is computed once (classifying many texts after the same examples, ranking documents for one query), and with
        `share_openings` (questions about one input: a decision) so is each question's opening (`question_header`)
        for the questions that share it; after inputs of their own it would only split each prompt in two.

        The same question gets the same probabilities alone or among others: the shared input is computed first, on
        its own; each scoring sequence's prompt has checkpoints at the input's end and its opening's end, and reuses
        no more than up to the last one it reaches (`reuse_limit`), so each stretch between them is always computed
        in one piece from the same place; and it is decoded in a batch of its own (engine/slots/batching.py), so
        nothing else in the step changes how its numbers round."""
        for i, (_, q) in enumerate(cases):
            check_question(q, f"questions[{i}]")
        options = options or RequestOptions()
        gen = self.generation
        settings, resident = await gen.lease(model_name, options, keep_alive)
        try:
            model = resident.model
            engine = model.engine
            if engine.info.can_rank:
                raise InvalidRequest(f"model '{model.name}' is a dedicated reranker: it ranks documents "
                                     "(/v1/rerank) but answers no questions", param="model")
            rendered = [await self._prompt(settings, model, messages, question_text(q), q.images, options)
                        for messages, q in cases]
            probe, _ = await self._prompt(settings, model, cases[0][0], _PROBE, [], options)
            shared = _common_length([probe, *(tokens for tokens, _ in rendered)])
            openings = await self._openings(settings, model, cases, rendered, shared, options) if share_openings \
                else [0] * len(cases)
            end = _end_token(engine)
            spellings = [answer_tokens(engine, q.answers, end) for _, q in cases]
            plans = [plan_nodes(tokens, spelled) for (tokens, _), spelled in zip(rendered, spellings, strict=True)]
            num_ctx = engine.info.num_ctx
            for plan in plans:
                longest = max(len(node.prompt) for node in plan.values())
                if longest >= num_ctx:
                    raise ContextOverflow(longest, num_ctx, engine.info.num_ctx_train)
            usage = Usage()
            first = rendered[0][0]
            if shared >= _MIN_PRIME and len(first) > shared and not any(images for _, images in rendered):
                # the input on its own, with one token more: that token is computed again by the next prime, the
                # input never (its last token computed alone would round differently from the rest)
                await self._score_all(engine, [(_Node(first[: shared + 1], [0]), [], 0)], 0, priority, usage)
            for depth in sorted({len(key) for plan in plans for key in plan}):  # an answer's first tokens first
                level = [(node, images, opening)
                         for plan, (_, images), opening in zip(plans, rendered, openings, strict=True)
                         for key, node in plan.items() if len(key) == depth]
                # questions that open alike run together, so their slots hold that opening for the next one
                level.sort(key=lambda job: job[0].prompt[shared: job[2]])
                await self._score_all(engine, level, shared, priority, usage)
        finally:
            gen.residency.release(resident)
        judgments = []
        for plan, spelled in zip(plans, spellings, strict=True):
            logs = [math.fsum(plan[tuple(t[:k])].scores[t[k]] for k in range(len(t))) for t in spelled]
            judgments.append(Judgment(renormalized(logs)))
        gen.observers.finished(model.name, Chunk(finish_reason="stop", usage=usage))
        return Decision(model.name, judgments, usage)

    async def _prompt(self, settings: ModelSettings, model: LoadedModel, messages: list[Message], text: str,
                      images: list[bytes], options: RequestOptions) -> tuple[list[int], list[PromptImage]]:
        """The tokens (and images' places) of the chat turn that asks `text` (with `images`) about `messages`,
        rendered as a chat reply would be, with thinking off (the answer comes first)."""
        request = ChatRequest(model.name, asked(messages, text, images), SamplingParams(), think=False,
                              options=options)
        prompt = await self.generation.chat_prompt(settings, model, request)
        return prompt.tokens, list(prompt.images)

    async def _openings(self, settings: ModelSettings, model: LoadedModel, cases: list[tuple[list[Message], Question]],
                        rendered: list[tuple[list[int], list[PromptImage]]], shared: int,
                        options: RequestOptions) -> list[int]:
        """Where each case's opening (`question_header`) ends in its prompt: where the prompt leaves one asking the
        same opening followed by `_PROBE`, which depends on that question alone; 0 where the opening is too short to
        be worth a stretch of its own, or the prompt has images."""
        ends = []
        probes: dict[tuple[int, str], list[int]] = {}
        for (messages, q), (tokens, images) in zip(cases, rendered, strict=True):
            if images:
                ends.append(0)
                continue
            header = question_header(q)
            key = (id(messages), header)
            if key not in probes:
                probes[key] = (await self._prompt(settings, model, messages, f"{header}\n{_PROBE}", [], options))[0]
            opening = _common_length([tokens, probes[key]])
            ends.append(opening if opening - shared >= _MIN_HEADER and opening < len(tokens) - 1 else 0)
        return ends

    async def _score_all(self, engine: Engine, jobs: list[tuple[_Node, list[PromptImage], int]], shared: int,
                         priority: int, usage: Usage) -> None:
        """Read every node's scores, at most twice the engine's slots (and _WINDOW) sequences in it at once; the
        first `shared` tokens are every prompt's, and a job's opening ends where it says (0: no opening): the
        checkpoints of its prompt (see `judge`). A full queue (other requests' work) is waited out for up to
        _OVERLOAD_WAIT seconds before the decision fails with it."""
        window = asyncio.Semaphore(min(_WINDOW, 2 * max(engine.info.num_parallel, 1)))

        async def one(node: _Node, images: list[PromptImage], opening: int, tokens: list[int]) -> None:
            marks = sorted({mark for mark in (shared, opening) if 0 < mark < len(node.prompt)})
            sampling = SamplingParams(temperature=0.0, max_tokens=1, score_tokens=tokens, draft_max=0,
                                      priority=priority, reuse_limit=marks[-1] if marks else None)
            async with window:
                waited = 0.0
                while True:
                    try:
                        stream = engine.submit(node.prompt, sampling, images=images or None,
                                               checkpoints=marks or None)
                        break
                    except Overloaded:
                        if waited >= _OVERLOAD_WAIT:
                            raise
                        await asyncio.sleep(_OVERLOAD_POLL)
                        waited += _OVERLOAD_POLL
                final = await _final(stream)
            if final.error is not None or len(final.scores) != len(tokens):
                raise EngineFailure(f"the engine could not score the answers: {final.error or 'no scores'}")
            node.scores.update(zip(tokens, final.scores, strict=True))
            if final.usage is not None:
                usage.prompt_tokens += final.usage.prompt_tokens
                usage.cached_tokens += final.usage.cached_tokens

        calls = [one(node, images, opening, node.tokens[i: i + MAX_SCORE_TOKENS])
                 for node, images, opening in jobs for i in range(0, len(node.tokens), MAX_SCORE_TOKENS)]
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


async def _final(stream: GenerationStream) -> Chunk:
    """The last chunk of `stream` (aborted when left early)."""
    last = Chunk()
    try:
        async for chunk in stream:
            last = chunk
    finally:
        if last.finish_reason is None:
            stream.abort()
    return last


def _common_length(prompts: list[list[int]]) -> int:
    """How many tokens every one of `prompts` begins with."""
    first = prompts[0]
    length = len(first)
    for other in prompts[1:]:
        length = min(length, len(other))
        length = next((i for i in range(length) if first[i] != other[i]), length)
    return length


def _end_token(engine: Engine) -> int | None:
    """The model's end-of-turn token id (what follows a complete answer), when its text is one token."""
    text = engine.info.eos_token
    if not text:
        return None
    tokens = engine.tokenize(text, add_special=False, parse_special=True)
    return tokens[0] if len(tokens) == 1 else None
