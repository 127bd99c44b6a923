"""The sampling options each engine's SPEC honours, and the one refusal of the others (engine/sampling_support.py):
an option an engine does not honour is a 400 naming it and the engine, the same option at its neutral value passes;
the service refuses it before the engine sees the request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmserve.chat.template import ChatTemplate
from lmserve.engine.registry import ENGINES, engine_named
from lmserve.engine.sampling_support import NEUTRAL, SAMPLING_OPTIONS, refuse_unhonoured
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.engine.spec import EngineSpec
from lmserve.errors import InvalidRequest
from lmserve.options import TABLE
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import ChatRequest, Message, RequestOptions, SamplingParams

ASKING: dict[str, SamplingParams] = {
    "mirostat": SamplingParams(mirostat=2),
    "mirostat_tau": SamplingParams(mirostat=1, mirostat_tau=3.0),
    "mirostat_eta": SamplingParams(mirostat=1, mirostat_eta=0.5),
    "typical_p": SamplingParams(typical_p=0.5),
    "draft_max": SamplingParams(draft_max=4),
    "top_k": SamplingParams(top_k=40),
    "top_p": SamplingParams(top_p=0.9),
    "min_p": SamplingParams(min_p=0.05),
    "repeat_penalty": SamplingParams(repeat_penalty=1.1),
    "presence_penalty": SamplingParams(presence_penalty=0.5),
    "frequency_penalty": SamplingParams(frequency_penalty=-0.5),
    "logit_bias": SamplingParams(logit_bias={5: -100.0}),
    "ignore_eos": SamplingParams(ignore_eos=True),
}
"""A request that asks for each option an engine may leave out."""
LEAVING: dict[str, list[SamplingParams]] = {
    "mirostat": [SamplingParams(mirostat=0)],
    "mirostat_tau": [SamplingParams(mirostat_tau=3.0)],  # tunes Mirostat only: nothing while mirostat is 0
    "mirostat_eta": [SamplingParams(mirostat_eta=0.5)],
    "typical_p": [SamplingParams(typical_p=1.0)],
    "draft_max": [SamplingParams(draft_max=0), SamplingParams(draft_max=None)],
    "top_k": [SamplingParams(top_k=0), SamplingParams(top_k=-1)],
    "top_p": [SamplingParams(top_p=1.0)],
    "min_p": [SamplingParams(min_p=0.0)],
    "repeat_penalty": [SamplingParams(repeat_penalty=1.0)],
    "presence_penalty": [SamplingParams(presence_penalty=0.0)],
    "frequency_penalty": [SamplingParams(frequency_penalty=0.0)],
    "logit_bias": [SamplingParams(logit_bias={})],
    "ignore_eos": [SamplingParams(ignore_eos=False)],
}
"""Requests that leave each such option at its neutral value."""
UNHONOURED = [(spec, name) for spec in ENGINES for name in NEUTRAL if name not in spec.sampling]


def test_the_sampling_options_are_the_options_tables() -> None:
    table = {name for name, entry in TABLE.items() if entry.lifetime == "sampling" and entry.field is not None}
    assert table - {"draft_num_predict"} == SAMPLING_OPTIONS  # draft_num_predict is draft_max by another name
    assert set(NEUTRAL) <= SAMPLING_OPTIONS and set(ASKING) == set(LEAVING) == set(NEUTRAL)


@pytest.mark.parametrize("spec", ENGINES, ids=lambda spec: spec.name)
def test_every_engine_honours_the_options_without_a_neutral_value(spec: EngineSpec) -> None:
    assert spec.sampling <= SAMPLING_OPTIONS
    assert SAMPLING_OPTIONS - set(NEUTRAL) <= spec.sampling


def test_vllm_lacks_mirostat_typical_sampling_and_per_request_drafts() -> None:
    assert SAMPLING_OPTIONS - engine_named("vllm").sampling == {"mirostat", "mirostat_tau", "mirostat_eta",
                                                                  "typical_p", "draft_max"}
    assert engine_named("llamacpp").sampling == engine_named("mlx").sampling == SAMPLING_OPTIONS


@pytest.mark.parametrize(("spec", "name"), UNHONOURED, ids=lambda x: x if isinstance(x, str) else x.name)
def test_an_option_an_engine_does_not_honour_is_a_400_naming_it(spec: EngineSpec, name: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        refuse_unhonoured(ASKING[name], spec)
    asked = "mirostat" if name.startswith("mirostat") else name  # what tunes Mirostat is refused as Mirostat
    assert refused.value.param == asked
    assert f"the {spec.label} engine has no" in str(refused.value) and f"leave {asked}" in str(refused.value)


@pytest.mark.parametrize(("spec", "name"), UNHONOURED, ids=lambda x: x if isinstance(x, str) else x.name)
def test_an_option_at_its_neutral_value_passes(spec: EngineSpec, name: str) -> None:
    for sampling in LEAVING[name]:
        refuse_unhonoured(sampling, spec)
    refuse_unhonoured(SamplingParams(), spec)


@pytest.mark.parametrize("spec", ENGINES, ids=lambda spec: spec.name)
def test_what_an_engine_honours_passes(spec: EngineSpec) -> None:
    for name in spec.sampling & set(NEUTRAL):
        refuse_unhonoured(ASKING[name], spec)


@pytest.mark.parametrize(("sampling", "param", "words"), [
    (SamplingParams(mirostat=2), "mirostat", "the vLLM engine has no Mirostat sampling; leave mirostat at 0"),
    (SamplingParams(typical_p=0.5), "typical_p", "the vLLM engine has no locally typical sampling; leave typical_p "
                                                 "at 1"),
    (SamplingParams(draft_max=4), "draft_max", "the vLLM engine has no per-request speculative decoding (draft_max); "
                                               "leave draft_max at 0"),
])
def test_vllms_refusals_say_what_it_lacks(sampling: SamplingParams, param: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(").replace(")", r"\)")) as refused:
        refuse_unhonoured(sampling, engine_named("vllm"))
    assert refused.value.param == param


@pytest.fixture
def fake() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=1))
    yield engine
    engine.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(("served_by", "refused"), [("vllm", True), ("mlx", False), ("llamacpp", False)])
async def test_the_service_refuses_before_the_engine_sees_the_request(fake: BatchingEngine, served_by: str,
                                                                      refused: bool) -> None:
    fake.info.engine = served_by  # as the engine of that name says it serves the model
    service = static_service([LoadedModel(name="m", engine=fake, template=ChatTemplate(None))])
    request = ChatRequest("m", [Message("user", "hi")], SamplingParams(max_tokens=2),
                          options=RequestOptions({"typical_p": 0.5}))
    if refused:
        with pytest.raises(InvalidRequest) as info:
            await service.generation.chat(request)
        assert info.value.param == "typical_p"
        return
    generation = await service.generation.chat(request)
    await generation.collect()
