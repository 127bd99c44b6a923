"""Options through HTTP: refused and unknown ones are 400s naming them in each dialect's shape; defaults by dialect."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_wire import assert_openai_error

from lmserve.engine.slots.batching import BatchingEngine
from lmserve.service import Service
from lmserve.types import RequestOptions, SamplingParams

USER = [{"role": "user", "content": "hi"}]

NATIVE_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # (route, options, the name the error gives)
    ("/api/generate", {"num_keep": "all"}, "num_keep"),  # ignored, but its type is still checked
    ("/api/generate", {"tfs_z": 0.5}, "tfs_z"),
    ("/api/generate", {"temprature": 0.5}, "temprature"),
    ("/api/generate", {"top_p": 0}, "top_p"),
    ("/api/chat", {"f16_kv": False}, "f16_kv"),
    ("/api/chat", {"mirostat": 5}, "mirostat"),
    ("/api/chat", {"use_mmap": "no"}, "use_mmap"),
    ("/api/embed", {"numa": True}, "numa"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "given", "name"), NATIVE_REFUSED)
async def test_native_refusals_name_the_option(client: httpx.AsyncClient, route: str, given: dict[str, Any],
                                               name: str) -> None:
    body = {"model": "fake", "prompt": "x", "messages": USER, "input": "x", "options": given, "stream": False}
    r = await client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and f"'{name}'" in r.json()["error"]


OPENAI_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"num_ctx": 8192}, "num_ctx"),
    ("/v1/chat/completions", {"vocab_only": True}, "vocab_only"),
    ("/v1/chat/completions", {"typical_p": 0}, "typical_p"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "given", "name"), OPENAI_REFUSED)
async def test_openai_refusals_name_the_field(client: httpx.AsyncClient, route: str, given: dict[str, Any],
                                              name: str) -> None:
    body = {"model": "fake", **({"messages": USER} if "chat" in route else {"prompt": "x"}), **given}
    r = await client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert assert_openai_error(r.json(), error_type="invalid_request_error")["param"] == name


async def test_a_modelfile_with_a_refused_parameter_is_refused_at_create(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/create", json={"model": "k", "modelfile": "FROM fake\nPARAMETER tfs_z 0.5",
                                               "stream": False})
    assert r.status_code == 400 and "'tfs_z'" in r.json()["error"]


IGNORED = {"num_keep": 24, "low_vram": True, "logits_all": True}
"""What the local runner's clients send that changes nothing on lmserve (Open WebUI's chat controls: num_keep 24)."""


@pytest.mark.parametrize("route", ["/api/chat", "/api/generate", "/v1/chat/completions"])
async def test_options_that_change_nothing_are_taken_and_ignored(client: httpx.AsyncClient, route: str) -> None:
    body: dict[str, Any] = {"model": "fake", "prompt": "x", "messages": USER, "stream": False}
    plain = await client.post(route, json={**body, "options": {"temperature": 0, "num_predict": 4},
                                           "temperature": 0, "max_tokens": 4})
    given = await client.post(route, json={**body, "options": {"temperature": 0, "num_predict": 4, **IGNORED},
                                           "temperature": 0, "max_tokens": 4, **({"num_keep": 24} if "v1" in route
                                                                                 else {})})
    assert plain.status_code == given.status_code == 200, given.text
    text = ("message", "content") if route == "/api/chat" else ("response",) if "generate" in route else None
    if text is None:
        assert given.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    else:
        assert given.json()[text[0]] == plain.json()[text[0]]


@pytest.fixture
def seen(engine: BatchingEngine, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The sampling of every sequence the fake backend starts."""
    record: list[SamplingParams] = []
    start = engine.backend.start

    def recording(slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
                  generated: list[int] | None = None) -> int:
        record.append(sampling)
        return start(slot, sampling, prompt, num_reused, generated)

    monkeypatch.setattr(engine.backend, "start", recording)
    return record


async def test_native_routes_sample_with_the_local_runners_defaults(
    client: httpx.AsyncClient, seen: list[SamplingParams]
) -> None:
    r = await client.post("/api/generate", json={"model": "fake", "prompt": "x", "stream": False,
                                                 "options": {"top_k": 7, "typical_p": 0.9}})
    assert r.status_code == 200, r.text
    s = seen[-1]
    assert (s.temperature, s.top_k, s.top_p, s.typical_p, s.repeat_penalty, s.repeat_last_n) == (
        0.8, 7, 0.9, 0.9, 1.1, 64)


async def test_openai_routes_keep_their_own_defaults(client: httpx.AsyncClient, seen: list[SamplingParams]) -> None:
    r = await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "typical_p": 0.5})
    assert r.status_code == 200, r.text
    assert seen[-1] == SamplingParams(typical_p=0.5)


def test_the_server_length_limit_is_the_last_layer(service: Service) -> None:
    service.precedence.n_predict = 5
    model = service.catalog.settings("fake")
    for dialect in ("native", "openai"):
        asked = RequestOptions(defaults=dialect)
        assert service.precedence.sampling(model, asked, SamplingParams()).max_tokens == 5
    assert service.precedence.sampling(model, RequestOptions({"num_predict": 7}), SamplingParams()).max_tokens == 7


def test_create_parameters_are_json_values_typed_by_the_table() -> None:
    """/api/create `parameters` are checked as JSON (2048.0 is an integer), not as text parsed again."""
    from lmserve.dialects.native import schemas as wire
    from lmserve.dialects.native.modelfiles import to_modelfile
    from lmserve.errors import InvalidRequest

    def create(parameters: dict[str, Any]) -> dict[str, Any]:
        body = wire.CreateBody.model_validate({"model": "m", "from": "base", "parameters": parameters})
        return to_modelfile(body).parameters

    assert create({"num_ctx": 2048.0, "temperature": 1, "stop": "\n", "use_mmap": False}) == {
        "num_ctx": 2048, "temperature": 1.0, "stop": ["\n"], "use_mmap": False}
    for parameters, param in [({"num_ctx": [1, 2]}, "num_ctx"), ({"temperature": "hot"}, "temperature"),
                              ({"tfs_z": 0.5}, "tfs_z"), ({"frobnicate": 1}, "frobnicate")]:
        with pytest.raises(InvalidRequest) as info:
            create(parameters)
        assert info.value.param == param
