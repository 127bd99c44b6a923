"""LoRA adapters through a real `lmserve serve` on llama.cpp (issue 44): four adapters over the embedded SmolLM2,
made by `peft` and converted by llama.cpp's own converter (tests/lora_adapters.py), served as models that share the
base's loaded weights, picked per request, mixed in one continuous batch.

One server for the module: `--lora` for two adapters, `--runtime-lora` for vLLM's load/unload routes (the other two
adapters are loaded through them, and through the native /api/create as a Modelfile ADAPTER).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anthropic
import httpx
import ollama
import psutil
import pytest

from tests.lora_adapters import smollm2_lora_gguf
from tests.test_server import Server
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lora import write_tiny_lora

BASE = "smollm2:135m"
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "4", "--lora", f"sea={smollm2_lora_gguf(1)}", "--lora", f"poet={smollm2_lora_gguf(2)}",
                 "--runtime-lora")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def models(server: Server) -> list[str]:
    """The base and four adapter models: two from --lora, one loaded at run time, one made by /api/create."""
    response = httpx.post(server.base_url + "/v1/load_lora_adapter",
                          json={"lora_name": "storm", "lora_path": str(smollm2_lora_gguf(3))}, timeout=60)
    assert response.status_code == 200, response.text
    with ollama.Client(host=server.base_url) as native:
        digest = native.create_blob(smollm2_lora_gguf(4))
        assert native.create(model="tide", from_=BASE, adapters={"tide.gguf": digest}).status == "success"
    return [BASE, "sea", "poet", "storm", "tide"]


def ask(server: Server, model: str, **extra: object) -> str:
    with server.client() as client:
        reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24,  # type: ignore[arg-type]
                                               extra_body=extra or None)
    return reply.choices[0].message.content or ""


def test_adapters_are_models_listed_with_their_base(server: Server, models: list[str]) -> None:
    with server.client() as client:
        cards = {card.id: card for card in client.models.list()}
    assert all(getattr(cards[f"{name}:latest"], "parent", None) == BASE for name in models[1:])
    assert getattr(cards[BASE], "parent", None) is None
    with ollama.Client(host=server.base_url) as native:
        shown = native.show("poet")
        assert shown.details.parent_model == BASE
        assert shown.modelinfo["lora.ranks"] == [8] and shown.modelinfo["lora.base_model"] == BASE
        assert "ADAPTER" in (shown.modelfile or "")


async def test_mixed_requests_each_answer_as_alone_over_one_loaded_base(server: Server, models: list[str]) -> None:
    alone = {model: ask(server, model) for model in models}
    assert len(set(alone.values())) == len(models)  # every adapter changes the answer
    rss = psutil.Process(server.process.pid).memory_info().rss
    async with server.async_client() as client:
        async def one(model: str) -> str:
            reply = await client.chat.completions.create(model=model, messages=QUESTION,  # type: ignore[arg-type]
                                                         temperature=0, max_tokens=24)
            return reply.choices[0].message.content or ""
        jobs = [models[i % len(models)] for i in range(8)]
        mixed = await asyncio.gather(*(one(model) for model in jobs))
    assert mixed == [alone[model] for model in jobs]
    ps = httpx.get(server.base_url + "/api/ps", timeout=30).json()["models"]
    assert all(entry["adapter_bytes"] > 0 for entry in ps)  # every name is bound to the one instance
    assert psutil.Process(server.process.pid).memory_info().rss - rss < 60 * 2**20  # no second base (98 MB)


def test_every_dialect_takes_an_adapter_model(server: Server, models: list[str]) -> None:
    with ollama.Client(host=server.base_url) as native:
        greedy = {"temperature": 0, "num_predict": 24, "repeat_penalty": 1.0}  # the native defaults penalize
        reply = native.chat(model="poet", messages=QUESTION, options=greedy)
    assert reply.message.content == ask(server, "poet")
    with anthropic.Anthropic(base_url=server.base_url, api_key="placeholder", max_retries=0) as client:
        message = client.messages.create(model="sea", max_tokens=24, messages=QUESTION,  # type: ignore[arg-type]
                                          extra_body={"temperature": 0})
    assert message.content[0].text == ask(server, "sea")  # type: ignore[union-attr]


def test_an_adapter_models_embeddings_are_the_adapters(server: Server, models: list[str]) -> None:
    with server.client() as client:
        vectors = {model: client.embeddings.create(model=model, input="the sea",
                                                   encoding_format="float").data[0].embedding
                   for model in (BASE, "sea", BASE)}
    assert vectors[BASE] != vectors["sea"]
    with ollama.Client(host=server.base_url) as native:
        assert native.embed(model="sea", input="the sea").embeddings[0] == pytest.approx(vectors["sea"], abs=1e-5)


def test_a_request_picks_adapters_by_id_or_name_at_a_scale(server: Server, models: list[str]) -> None:
    listed = httpx.get(server.base_url + "/lora-adapters", timeout=30).json()
    assert [(entry["id"], entry["name"], entry["scale"]) for entry in listed] == \
        [(0, "sea", 0.0), (1, "poet", 0.0), (2, "storm", 0.0)]
    assert ask(server, BASE, lora=[{"id": 1}]) == ask(server, "poet")
    assert ask(server, BASE, lora=[{"name": "tide", "scale": 1.0}]) == ask(server, "tide")
    assert ask(server, "poet", lora=[{"id": 1, "scale": 0.0}]) == ask(server, BASE)  # scale 0: off
    half = ask(server, BASE, lora=[{"id": 1, "scale": 0.5}])
    assert half not in (ask(server, BASE), ask(server, "poet"))
    response = httpx.post(server.base_url + "/lora-adapters", json=[{"id": 1, "scale": 0.5}], timeout=30)
    assert response.status_code == 200 and response.json()[1]["scale"] == 0.5
    try:
        assert ask(server, BASE) == half  # global scales apply to the base's plain requests
        assert ask(server, "sea") == ask(server, "sea", lora=[{"id": 0}])  # not to an adapter model's
    finally:
        httpx.post(server.base_url + "/lora-adapters", json=[], timeout=30)


def test_bad_adapters_are_400s_naming_why(server: Server, models: list[str], tmp_path_factory: pytest.TempPathFactory
                                         ) -> None:
    folder = tmp_path_factory.mktemp("bad-lora")
    other = write_tiny_lora(folder / "other.gguf", write_tiny_llama(folder / "tiny.gguf"))
    corrupt = folder / "corrupt.gguf"
    corrupt.write_bytes(smollm2_lora_gguf(1).read_bytes()[:5000])
    cases = [
        ("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(other)}, "does not fit this model"),
        ("/v1/load_lora_adapter", {"lora_name": "corrupt", "lora_path": str(corrupt)}, "not a valid GGUF file"),
        ("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": str(corrupt)}, "is loaded already"),
        ("/v1/chat/completions", {"model": BASE, "messages": QUESTION, "lora": [{"id": 9}]}, "no LoRA adapter has id"),
        ("/v1/chat/completions", {"model": BASE, "messages": QUESTION, "lora": [{"name": BASE}]}, "no LoRA adapter"),
        ("/lora-adapters", [{"id": 9, "scale": 1}], "no LoRA adapter has id 9"),
    ]
    for path, body, reason in cases:
        response = httpx.post(server.base_url + path, json=body, timeout=60)
        assert response.status_code == 400 and reason in response.json()["error"]["message"], (path, response.text)
    with ollama.Client(host=server.base_url) as native, pytest.raises(ollama.ResponseError) as caught:
        native.create(model="wrong", from_=BASE, adapters={"other.gguf": native.create_blob(other)})
    assert caught.value.status_code == 400 and "does not fit this model" in caught.value.error


def test_an_adapter_unloaded_at_run_time_is_gone(server: Server, models: list[str]) -> None:
    response = httpx.post(server.base_url + "/v1/load_lora_adapter",
                          json={"lora_name": "brief", "lora_path": str(smollm2_lora_gguf(1))}, timeout=60)
    assert response.status_code == 200, response.text
    assert ask(server, "brief") == ask(server, "sea")  # the same file
    response = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "brief"}, timeout=60)
    assert response.status_code == 200, response.text
    response = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "brief", "messages": QUESTION},
                          timeout=60)
    assert response.status_code == 404
