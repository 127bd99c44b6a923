"""An MLX-format repository from the hub, the way the seed launches the Apple-silicon server:
`lmserve serve --model <org>/<repo> --port P` (here with `--engine mlx`: on this Linux machine `auto` gives
repositories to vLLM). The repository is mlx-lm's own 4-bit layout (what mlx-community publishes; mlx_lm.convert
makes it from the tests' tiny Llama) on the fake hub (tests/hub.py): the server pulls it at start, stores it like any
repository, lists it as Q4 and serves it; `lmserve pull` of a second copy stores it the same way.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from tests.hf_repos import tiny_llama_repo
from tests.hub import FakeHub, serve_hub
from tests.test_server import Server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="the MLX engine needs mlx-lm")

REPOSITORY = "mlx-test/tiny-llama-4bit"
COPY = "mlx-test/tiny-llama-4bit-copy"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("mlx-4bit") / "repo"
    convert(str(tiny_llama_repo()), mlx_path=str(out), quantize=True, q_group_size=64, q_bits=4)
    return {path.name: path.read_bytes() for path in Path(out).iterdir() if path.is_file()}


@pytest.fixture(scope="module")
def hub(files: dict[str, bytes]) -> Iterator[FakeHub]:
    with serve_hub({REPOSITORY: files, COPY: files}) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"LMSERVE_HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(tmp_path_factory.mktemp("hf-home"))}
    srv = Server("--model", REPOSITORY, "--engine", "mlx", env=env)
    yield srv
    srv.stop()


def test_the_seeds_launch_pulls_stores_and_serves_an_mlx_quantized_repository(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client:
        [listed] = [m for m in client.list().models if m.model == f"{REPOSITORY}:latest"]
        assert listed.details is not None
        assert (listed.details.format, listed.details.family, listed.details.quantization_level) == (
            "safetensors", "llama", "Q4")
        reply = client.generate(model=REPOSITORY, prompt="hello world", raw=True,
                                options={"temperature": 0, "num_predict": 4})
        assert reply.eval_count == 4
    ps = httpx.get(server.base_url + "/api/ps", timeout=30).json()["models"]
    assert ps[0]["details"]["quantization_level"] == "Q4"


def test_pull_stores_an_mlx_repository_like_any_other(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client:
        statuses = [part.status for part in client.pull(COPY, stream=True)]
        assert "pulling model.safetensors" in statuses and statuses[-1] == "success"
        reply = client.chat(model=COPY, messages=[{"role": "user", "content": "hi"}],
                            options={"temperature": 0, "num_predict": 3})
        assert reply.done and reply.eval_count == 3
