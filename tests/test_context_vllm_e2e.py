"""Context sizing on vLLM, the same rule as on llama.cpp: a repository whose `max_position_embeddings` (1024) is below
the default context loads with it, and `-c` above it is capped there with a warning naming both numbers; `ps` and
the 400 for a prompt that does not fit say the context in force and the trained length."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lmserve.engine.vllm.args import VllmOptions
from lmserve.engine.vllm.memory import context_choice
from lmserve.types import AUTO_CONTEXT
from tests.hf_repos import smollm2_repo
from tests.test_server import Server

TRAINED = 1024
ASKED = 4096


@pytest.fixture(scope="module")
def short_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 repository (its weights linked) with max_position_embeddings 1024."""
    source = smollm2_repo()
    repo = tmp_path_factory.mktemp("smollm2-1024")
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            (repo / item.name).symlink_to(item)
        else:
            shutil.copy(item, repo / item.name)
    config = json.loads((source / "config.json").read_text())
    (repo / "config.json").write_text(json.dumps({**config, "max_position_embeddings": TRAINED}))
    return repo


def test_auto_is_at_most_max_position_embeddings(short_repo: Path) -> None:
    config = json.loads((short_repo / "config.json").read_text())
    choice = context_choice(short_repo, VllmOptions(num_ctx=AUTO_CONTEXT, num_parallel=4, dtype="float32"), config)
    assert (choice.num_ctx, choice.trained, choice.is_capped) == (TRAINED, TRAINED, False)


@pytest.fixture(scope="module")
def server(short_repo: Path) -> Iterator[Server]:
    srv = Server(str(short_repo), "--dtype", "float32", "-c", str(ASKED), "-np", "1")
    yield srv
    srv.stop()


def test_a_context_above_max_position_embeddings_is_capped_and_said(server: Server) -> None:
    models = httpx.get(server.base_url + "/api/ps").json()["models"]
    assert [m["context_length"] for m in models] == [TRAINED]
    model = server.repository_model()
    with server.client() as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, max_tokens=4,
                                       messages=[{"role": "user", "content": "hello " * 1200}])
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    assert f"this model's context is {TRAINED} tokens per sequence" in error["message"]
    assert f"trained for at most {TRAINED} tokens, so it cannot take this prompt" in error["message"]
    out = server.stop()
    assert f"a context of {ASKED} tokens per sequence was asked for" in out, out
    assert f"but the model was trained for {TRAINED}: its context is {TRAINED} tokens per sequence" in out
    assert f"loaded {model}: context {TRAINED} tokens per sequence x 1 slot (asked, trained for {TRAINED})" in out
