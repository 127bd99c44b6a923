"""Spec for lmserve.service.fim: a fill-in-the-middle prompt is BOS, any extra files, then PRE prefix SUF suffix MID
and the prompt (llama-server's order), built from the model's FIM token ids; a model without them is a 400 naming
why; a Modelfile TEMPLATE that reads `.Suffix` renders the insert itself (Ollama's way)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.chat.template import ChatTemplate
from lmserve.engine.protocol import FimTokens
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest
from lmserve.service import fim
from lmserve.service.residency import LoadedModel, Prompter
from lmserve.types import CompletionRequest, Infill, SamplingParams

PRE, SUF, MID, REPO, SEP = 250, 251, 252, 253, 254


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend())  # tokens are a text's UTF-8 bytes; no BOS
    yield engine
    engine.close()


def model(engine: BatchingEngine, tokens: FimTokens | None, template: Prompter | None = None) -> LoadedModel:
    engine.info.fim = tokens
    return LoadedModel(name="coder", engine=engine, template=template or ChatTemplate(None))


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_prefix_suffix_middle_in_llama_servers_order(engine: BatchingEngine) -> None:
    coder = model(engine, FimTokens(PRE, SUF, MID))
    assert fim.infill_prompt(coder, Infill("def f(", "  return x")) == [PRE, *ids("def f("), SUF,
                                                                        *ids("  return x"), MID]


def test_the_prompt_follows_the_middle_token(engine: BatchingEngine) -> None:
    coder = model(engine, FimTokens(PRE, SUF, MID))
    assert fim.infill_prompt(coder, Infill("a", "c"), "b") == [PRE, *ids("a"), SUF, *ids("c"), MID, *ids("b")]


def test_an_empty_suffix_or_prefix_adds_no_tokens(engine: BatchingEngine) -> None:
    coder = model(engine, FimTokens(PRE, SUF, MID))
    assert fim.infill_prompt(coder, Infill("", "")) == [PRE, SUF, MID]


def test_extra_files_use_the_repository_pattern_when_the_vocabulary_has_it(engine: BatchingEngine) -> None:
    coder = model(engine, FimTokens(PRE, SUF, MID, REPO, SEP))
    prompt = fim.infill_prompt(coder, Infill("x", "y", [("util.py", "def g(): pass")]))
    assert prompt == [REPO, *ids("myproject\n"), SEP, *ids("util.py\n"), *ids("def g(): pass"),
                      SEP, *ids("filename\n"), PRE, *ids("x"), SUF, *ids("y"), MID]


def test_extra_files_without_separator_tokens_follow_a_snippet_marker(engine: BatchingEngine) -> None:
    coder = model(engine, FimTokens(PRE, SUF, MID))
    prompt = fim.infill_prompt(coder, Infill("x", "y", [("a.py", "A"), ("b.py", "B")]))
    marker = ids(fim.SNIPPET_MARKER)
    assert prompt == [*marker, *ids("A"), *marker, *ids("B"), PRE, *ids("x"), SUF, *ids("y"), MID]


def test_a_model_without_fim_tokens_is_a_400_naming_why(engine: BatchingEngine) -> None:
    with pytest.raises(InvalidRequest) as caught:
        fim.infill_prompt(model(engine, None), Infill("a", "b"))
    assert caught.value.param == "suffix"
    assert "fill-in-the-middle tokens" in caught.value.message


def test_a_suffix_template_renders_the_insert_without_fim_tokens(engine: BatchingEngine) -> None:
    template = GoChatTemplate("{{ if .Suffix }}<P>{{ .Prompt }}<S>{{ .Suffix }}<M>{{ else }}{{ .Prompt }}{{ end }}")
    coder = model(engine, None, template)
    request = CompletionRequest("coder", "", SamplingParams(), infill=Infill("def f(", "return 1"))
    assert fim.completion_prompt(coder, request) == ids("<P>def f(<S>return 1<M>")


def test_a_completion_without_infill_is_its_context_and_prompt(engine: BatchingEngine) -> None:
    request = CompletionRequest("coder", "hi", SamplingParams(), context=[7, 8])
    assert fim.completion_prompt(model(engine, None), request) == [7, 8, *ids("hi")]


def test_suffix_with_context_is_refused(engine: BatchingEngine) -> None:
    request = CompletionRequest("coder", "", SamplingParams(), context=[7], infill=Infill("a", "b"))
    with pytest.raises(InvalidRequest) as caught:
        fim.completion_prompt(model(engine, FimTokens(PRE, SUF, MID)), request)
    assert caught.value.param == "context"
