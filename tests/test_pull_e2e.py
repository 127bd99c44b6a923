"""End to end: `/api/pull` of a hub model through a real server, from a fake hub on 127.0.0.1 (nothing leaves it).

The fake hub (tests/hub.py) serves `test-org/tiny-GGUF` with tiny loadable GGUFs and `test-org/tiny-llama`, a tiny
safetensors repository (listed and shown here; loading it is the vLLM engine's tests' job); the server subprocess
is pointed at it with LMSERVE_HF_ENDPOINT. Pulled with the official `ollama` client and with `lmserve pull`.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import ollama
import pytest
from PIL import Image

from tests.hub import TINY_TEMPLATE, FakeHub, serve_hub, sha256_hex, tiny_repository
from tests.test_server import Server
from tests.tiny_lfm2 import write_tiny_lfm2
from tests.tiny_lfm2_vl import LFM2_VL_SPECIALS, write_tiny_lfm2_mmproj

REPO = "test-org/tiny-GGUF"
MODEL = f"hf.co/{REPO}:Q8_0"
REPOSITORY = "test-org/tiny-llama"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("hub-files")
    return {
        "README.md": b"# tiny\n",
        # A tiny LFM2-VL: two text GGUFs (the file names pick the quant) and the projector that fits them.
        "tiny-Q8_0.gguf": write_tiny_lfm2(folder / "q8.gguf", seed=1, extra_specials=LFM2_VL_SPECIALS).read_bytes(),
        "tiny-F16.gguf": write_tiny_lfm2(folder / "f16.gguf", seed=2, extra_specials=LFM2_VL_SPECIALS).read_bytes(),
        "mmproj-tiny-F16.gguf": write_tiny_lfm2_mmproj(folder / "mmproj.gguf", seed=3).read_bytes(),
    }


@pytest.fixture(scope="module")
def hub(files: dict[str, bytes]) -> Iterator[FakeHub]:
    with serve_hub({REPO: files, REPOSITORY: tiny_repository()}) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    hf_home = str(tmp_path_factory.mktemp("hf-home"))
    env = {"LMSERVE_HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": hf_home}
    srv = Server("-np", "2", "-c", "512", env=env)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url) as c:
        yield c


def downloads(hub: FakeHub, data: bytes) -> int:
    """GETs of a file's bytes (the hub redirects GGUF downloads to its CDN, by sha256)."""
    return len(hub.requests_for(f"/cdn/{sha256_hex(data)}"))


def test_pull_streams_progress_registers_the_model_and_it_generates(
    client: ollama.Client, hub: FakeHub, files: dict[str, bytes]
) -> None:
    parts = list(client.pull(MODEL, stream=True))

    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert statuses[-2:] == ["writing manifest", "success"]
    model = files["tiny-Q8_0.gguf"]
    model_lines = [p for p in parts if p.status == "pulling tiny-Q8_0.gguf"]
    assert model_lines and {p.digest for p in model_lines} == {f"sha256:{sha256_hex(model)}"}
    assert model_lines[-1].total == model_lines[-1].completed == len(model)
    assert "pulling mmproj-tiny-F16.gguf" in statuses  # the repo's projector comes along
    assert "verifying sha256 digest" in statuses
    assert downloads(hub, model) == 1
    assert downloads(hub, files["tiny-F16.gguf"]) == 0

    assert MODEL in [m.model for m in client.list().models]
    shown = client.show(MODEL)
    assert shown.details is not None and shown.details.family == "lfm2"
    assert "vision" in (shown.capabilities or [])
    generated = client.generate(model=MODEL, prompt="hi", raw=True, options={"num_predict": 3})
    assert generated.done and generated.eval_count is not None and 0 < generated.eval_count <= 3
    image = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(image, "PNG")
    seen = client.generate(model=MODEL, prompt="what is it?", images=[image.getvalue()], options={"num_predict": 3})
    assert seen.prompt_eval_count is not None and seen.prompt_eval_count > 64  # the pulled projector sees it
    assert generated.done and generated.eval_count is not None and 0 < generated.eval_count <= 3
    assert isinstance(generated.response, str)


def test_second_pull_downloads_nothing(client: ollama.Client, hub: FakeHub, files: dict[str, bytes]) -> None:
    list(client.pull(MODEL, stream=True))
    before = len(hub.requests)
    assert client.pull(MODEL).status == "success"  # stream=False: one object
    gets = [r for r in hub.requests[before:] if r.method == "GET" and r.path.startswith("/cdn/")]
    assert gets == []
    assert downloads(hub, files["tiny-Q8_0.gguf"]) == 1


def test_a_corrupt_partial_download_fails_mid_stream_then_pulls_again(
    client: ollama.Client, server: Server, hub: FakeHub, files: dict[str, bytes]
) -> None:
    data = files["tiny-F16.gguf"]
    blobs = Path(server.models_dir) / "hf-cache" / "models--test-org--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / f"{sha256_hex(data)}.partial").write_bytes(b"X" * 1000)
    seen: list[ollama.ProgressResponse] = []
    with pytest.raises(ollama.ResponseError) as info:
        for part in client.pull(f"hf.co/{REPO}:F16", stream=True):
            seen.append(part)
    assert "digest mismatch" in str(info.value)  # an error line after the stream began
    resumed = next(p for p in seen if p.status == "pulling tiny-F16.gguf")
    assert (resumed.completed, resumed.total) == (1000, len(data))  # it resumed the partial file
    [ranged] = hub.requests_for(f"/cdn/{sha256_hex(data)}")
    assert ranged.headers["range"] == "bytes=1000-"

    assert client.pull(f"hf.co/{REPO}:F16").status == "success"
    assert downloads(hub, data) == 2
    assert f"hf.co/{REPO}:F16" in [m.model for m in client.list().models]


@pytest.mark.parametrize(
    ("name", "status"),
    [("hf.co/test-org/missing-GGUF", 404), ("hf.co/test-org/tiny-GGUF:Q2_K", 400), ("llama3", 400)],
)
def test_pull_errors_come_before_streaming(client: ollama.Client, name: str, status: int) -> None:
    for stream in (True, False):
        with pytest.raises(ollama.ResponseError) as info:
            result = client.pull(name, stream=stream)
            if stream:
                list(cast(Iterator[Any], result))
        assert info.value.status_code == status
    if name == "llama3":
        assert "hf.co" in str(info.value)


def test_cli_pull_prints_progress_and_success(server: Server) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    env["LMSERVE_HOST"] = server.base_url.removeprefix("http://")
    done = subprocess.run([sys.executable, "-m", "lmserve", "pull", f"hf.co/{REPO}"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "success" in done.stdout + done.stderr
    listed = subprocess.run([sys.executable, "-m", "lmserve", "list"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert f"hf.co/{REPO}:latest" in listed.stdout


@pytest.mark.parametrize("name", [REPOSITORY, f"hf.co/{REPOSITORY}"])
def test_pull_of_a_safetensors_repository_then_tags_show_and_models_list_it(
    client: ollama.Client, server: Server, name: str
) -> None:
    parts = list(client.pull(name, stream=True))

    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert {"pulling config.json", "pulling model.safetensors", "pulling tokenizer.json"} <= set(statuses)
    assert "pulling README.md" not in statuses and "pulling pytorch_model.bin" not in statuses
    assert statuses[-2:] == ["writing manifest", "success"]

    stored = f"{name}:latest"
    [listed] = [m for m in client.list().models if m.model == stored]
    assert listed.details is not None
    assert (listed.details.format, listed.details.family, listed.details.quantization_level) == (
        "safetensors", "llama", "BF16")
    shown = client.show(name)
    assert shown.details is not None and shown.details.format == "safetensors"
    assert shown.template == TINY_TEMPLATE
    assert "tools" in (shown.capabilities or [])
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    openai_ids = [m["id"] for m in httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]]
    assert stored in openai_ids
