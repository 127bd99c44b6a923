"""Fill-in-the-middle end to end: `suffix` on /v1/completions (the `openai` client) and on /api/generate (the
`ollama` client), and llama-server's /infill, through a real `lmserve serve`.

On llama.cpp, a tiny GGUF whose vocabulary has FIM tokens (tests/tiny_gguf.py, `fim=True`: found through the
`tokenizer.ggml.fim_*_token_id` keys) is created next to the embedded SmolLM2, which has none (a 400 naming why),
and a SmolLM2 whose Modelfile TEMPLATE reads `.Suffix` (Ollama's insert form). The prompt is checked by its tokens:
the native `context` starts with BOS PRE prefix SUF suffix MID. On vLLM, a tiny Llama repository whose tokenizer
has StarCoder's `<fim_prefix>` `<fim_suffix>` `<fim_middle>` (renamed from three unused specials) fills in too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.hf_repos import tiny_llama_repo
from tests.test_server import Server
from tests.tiny_gguf import CHATML_TEMPLATE, fim_token_ids, write_tiny_llama

PRE, SUF, MID = fim_token_ids()
BOS = 1
INSERT_TEMPLATE = "{{ if .Suffix }}<fim_prefix>{{ .Prompt }}<fim_suffix>{{ .Suffix }}<fim_middle>{{ else }}" \
                  "{{ .Prompt }}{{ end }}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server("-np", "2")
    path = write_tiny_llama(tmp_path_factory.mktemp("fim") / "coder.gguf", chat_template=CHATML_TEMPLATE, fim=True)
    with ollama.Client(host=srv.base_url) as native:
        assert native.create(model="coder", files={"coder.gguf": native.create_blob(path)}).status == "success"
        assert native.create(model="smol-insert", from_="smollm2:135m", template=INSERT_TEMPLATE).status == "success"
    yield srv
    srv.stop()


def lenient(server: Server) -> openai.OpenAI:
    """A client that does not validate strictly: a streamed legacy completion's pieces have `finish_reason: null`,
    which the client's `Completion` type refuses."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0)


def tokenize(server: Server, model: str, text: str) -> list[int]:
    response = httpx.post(server.base_url + "/tokenize", json={"model": model, "content": text}, timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def test_completions_suffix_fills_the_middle(server: Server) -> None:
    with server.client() as client, lenient(server) as plain:
        whole = client.completions.create(model="coder", prompt="def add(a, b):", suffix="    return c",
                                          max_tokens=5, temperature=0)
        pieces = list(plain.completions.create(model="coder", prompt="def add(a, b):", suffix="    return c",
                                                max_tokens=5, temperature=0, stream=True))
    prefix, suffix = tokenize(server, "coder", "def add(a, b):"), tokenize(server, "coder", "    return c")
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == 4 + len(prefix) + len(suffix)  # BOS PRE … SUF … MID
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_native_suffix_prompt_is_bos_pre_prefix_suf_suffix_mid(server: Server) -> None:
    with ollama.Client(host=server.base_url) as native:
        reply = native.generate(model="coder", prompt="x = ", suffix="\nprint(x)", options={"num_predict": 4,
                                                                                           "temperature": 0})
        streamed = "".join(part.response for part in native.generate(
            model="coder", prompt="x = ", suffix="\nprint(x)", options={"num_predict": 4, "temperature": 0},
            stream=True))
    prefix, suffix = tokenize(server, "coder", "x = "), tokenize(server, "coder", "\nprint(x)")
    assert reply.context is not None
    assert list(reply.context[: 4 + len(prefix) + len(suffix)]) == [BOS, PRE, *prefix, SUF, *suffix, MID]
    assert streamed == reply.response


def test_infill_route(server: Server) -> None:
    body: dict[str, Any] = {"model": "coder", "input_prefix": "a = 1\n", "input_suffix": "\nb = 2",
                            "input_extra": [{"filename": "util.py", "text": "c = 3"}], "n_predict": 4,
                            "temperature": 0}
    reply = httpx.post(server.base_url + "/infill", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["stop"] is True and answer["stop_type"] in ("eos", "limit")
    assert answer["tokens_predicted"] <= 4 and answer["tokens_evaluated"] > 6
    with httpx.stream("POST", server.base_url + "/infill", json={**body, "stream": True}, timeout=60) as streamed:
        events = [json.loads(line.removeprefix("data: ")) for line in streamed.iter_lines() if line]
    assert "".join(event["content"] for event in events) == answer["content"]
    assert [event["stop"] for event in events][-1] is True


def test_a_model_without_fim_tokens_is_a_400_naming_why(server: Server) -> None:
    with server.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smollm2:135m", prompt="def f(", suffix="return 1", max_tokens=4)
    assert caught.value.body is not None
    assert "fill-in-the-middle" in str(caught.value.body)
    infill = httpx.post(server.base_url + "/infill", json={"model": "smollm2:135m", "input_prefix": "a"}, timeout=60)
    assert infill.status_code == 400
    with ollama.Client(host=server.base_url) as native, pytest.raises(ollama.ResponseError) as native_caught:
        native.generate(model="smollm2:135m", prompt="def f(", suffix="return 1")
    assert native_caught.value.status_code == 400


def test_a_suffix_template_renders_the_insert(server: Server) -> None:
    with ollama.Client(host=server.base_url) as native:
        reply = native.generate(model="smol-insert", prompt="def f(", suffix="return 1",
                                options={"num_predict": 3, "temperature": 0})
    expected = tokenize(server, "smol-insert", "<fim_prefix>def f(<fim_suffix>return 1<fim_middle>")
    assert reply.context is not None
    assert list(reply.context[: len(expected)]) == expected


# ---- vLLM -------------------------------------------------------------------------------------------------------


def fim_repo(out: Path) -> Path:
    """The tiny Llama repository with three unused special tokens renamed to StarCoder's FIM tokens."""
    shutil.copytree(tiny_llama_repo(), out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    renames = {"<issue_start>": "<fim_prefix>", "<issue_comment>": "<fim_suffix>", "<issue_closed>": "<fim_middle>"}
    for token in tokenizer["added_tokens"]:
        token["content"] = renames.get(token["content"], token["content"])
    tokenizer["model"]["vocab"] = {renames.get(k, k): v for k, v in tokenizer["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(str(fim_repo(tmp_path_factory.mktemp("vllm-fim") / "coder")), "--dtype", "float32")
    yield srv
    srv.stop()


def test_vllm_suffix_fills_the_middle(vllm_server: Server) -> None:
    model = vllm_server.repository_model()
    tokens = httpx.post(vllm_server.base_url + "/tokenize", json={"prompt": "<fim_prefix><fim_suffix><fim_middle>",
                                                                  "add_special_tokens": False}, timeout=60).json()
    assert tokens["tokens"] == [8, 9, 10]
    with vllm_server.client() as client, lenient(vllm_server) as plain:
        whole = client.completions.create(model=model, prompt="a = 1", suffix="b = 2", max_tokens=4, temperature=0)
        streamed = "".join(p.choices[0].text for p in plain.completions.create(
            model=model, prompt="a = 1", suffix="b = 2", max_tokens=4, temperature=0, stream=True) if p.choices)
    prefix = tokenize(vllm_server, model, "a = 1")
    suffix = tokenize(vllm_server, model, "b = 2")
    assert whole.usage is not None and whole.usage.prompt_tokens == 3 + len(prefix) + len(suffix)
    assert streamed == whole.choices[0].text
    with ollama.Client(host=vllm_server.base_url) as native:
        reply = native.generate(model=model, prompt="a = 1", suffix="b = 2", options={"num_predict": 4,
                                                                                     "temperature": 0})
    assert reply.context is not None
    assert list(reply.context[: 3 + len(prefix) + len(suffix)]) == [8, *prefix, 9, *suffix, 10]
    infill = httpx.post(vllm_server.base_url + "/infill", json={"input_prefix": "a = 1", "input_suffix": "b = 2",
                                                               "n_predict": 4, "temperature": 0}, timeout=60)
    assert infill.status_code == 200, infill.text
    assert infill.json()["content"] == whole.choices[0].text
