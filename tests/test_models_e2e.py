"""End to end: the model store through a real server, with the official `ollama` client and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from lmserve.store.modelfile import parse as parse_modelfile
from tests.test_server import MODEL, Server
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lora import write_tiny_lora


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "512")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    write_tiny_llama(path)
    return path


def names(client: ollama.Client) -> list[str]:
    return sorted(m.model or "" for m in client.list().models)


def test_the_embedded_model_is_registered_without_download(client: ollama.Client) -> None:
    assert MODEL in names(client)


def test_create_from_a_stored_model_with_system_and_parameters(client: ollama.Client) -> None:
    result = client.create(model="pirate", from_=MODEL, system="You are a pirate.",
                           parameters={"temperature": 0, "stop": ["\n\n", "Arr"]})
    assert result.status == "success"
    shown = client.show("pirate")
    assert shown.details is not None and shown.details.parent_model == MODEL
    modelfile = parse_modelfile(shown.modelfile or "")
    assert modelfile.parameters == {"temperature": 0.0, "stop": ["\n\n", "Arr"]}
    assert modelfile.system == "You are a pirate."
    reply = client.chat(model="pirate", messages=[{"role": "user", "content": "Say hello."}],
                        options={"num_predict": 12})
    assert reply.done
    assert "pirate:latest" in names(client)


def test_copy_and_delete(client: ollama.Client) -> None:
    client.copy(MODEL, "smol-copy")
    assert "smol-copy:latest" in names(client)
    client.delete("smol-copy")
    assert "smol-copy:latest" not in names(client)
    assert MODEL in names(client)  # the shared blob stays with the model still using it
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("smol-copy")
    assert info.value.status_code == 404


def test_create_from_an_uploaded_blob_and_quantize(client: ollama.Client, tiny_f32: Path) -> None:
    digest = client.create_blob(tiny_f32)
    assert digest.startswith("sha256:")
    assert client.create(model="tiny", files={"tiny-f32.gguf": digest}).status == "success"
    generated = client.generate(model="tiny", prompt="ab", raw=True, options={"num_predict": 3, "temperature": 0})
    assert generated.done and generated.eval_count is not None and generated.eval_count <= 3
    assert client.create(model="tiny-q8", from_="tiny", quantize="q8_0").status == "success"
    details = client.show("tiny-q8").details
    assert details is not None and details.quantization_level == "Q8_0"
    assert [m.model for m in client.ps().models if m.model == "tiny:latest"] == ["tiny:latest"]
    client.generate(model="tiny", prompt="", keep_alive=0)
    assert "tiny:latest" not in [m.model for m in client.ps().models]


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"model": "x", "files": {"a.gguf": "sha256:" + "0" * 64}}, 400),
        ({"model": "x", "from_": "no-such-model"}, 404),
        ({"model": "../evil", "from_": MODEL}, 400),
        ({"model": "x", "from_": MODEL, "quantize": "q3_xyz"}, 400),
    ],
)
def test_bad_creates_are_refused(client: ollama.Client, kwargs: dict[str, object], status: int) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.create(**kwargs)  # type: ignore[arg-type]
    assert info.value.status_code == status


def test_cli_create_list_show_rm(server: Server, tiny_f32: Path, tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.gguf").write_bytes(tiny_f32.read_bytes())
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(
        "FROM ./weights/model.gguf\n"
        'TEMPLATE """<|startoftext|><|im_start|>system\n{{ .System }}<|im_end|>\n<|im_start|>user\n'
        '{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n"""\n'
        "PARAMETER temperature 0.1\nPARAMETER top_k 50\nPARAMETER repeat_penalty 1.05\n"
        'PARAMETER stop "<|im_end|>"\nPARAMETER stop "<|endoftext|>"\n'
    )
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lmserve", *args], env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    created = cli("create", "lfm-style", "-f", str(modelfile))
    assert created.returncode == 0, created.stderr
    assert "lfm-style" in cli("list").stdout
    shown = cli("show", "lfm-style", "--modelfile")
    assert shown.returncode == 0
    assert parse_modelfile(shown.stdout).parameters["stop"] == ["<|im_end|>", "<|endoftext|>"]
    ran = cli("run", "lfm-style", "hello")
    assert ran.returncode == 0, ran.stderr
    assert cli("rm", "lfm-style").returncode == 0
    missing = cli("rm", "lfm-style")
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_the_served_model_stays_loaded_after_requests_with_the_default_keep_alive(client: ollama.Client) -> None:
    client.generate(model=MODEL, prompt="Hi", options={"num_predict": 2})
    served = [m for m in client.ps().models if m.model == MODEL]
    assert served and served[0].expires_at is not None and served[0].expires_at.year == 9999


def test_load_time_parameters_request_over_modelfile_over_server(client: ollama.Client) -> None:
    client.create(model="short-ctx", from_=MODEL, parameters={"num_ctx": 128})
    long_prompt = "word " * 400  # ~400 tokens: over the Modelfile's context (llama.cpp pads 128 to 256), under 1024
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="short-ctx", prompt=long_prompt, raw=True, options={"num_predict": 1})
    assert info.value.status_code == 400 and "context" in str(info.value)
    options = {"num_predict": 1, "num_ctx": 1024}
    reply = client.generate(model="short-ctx", prompt=long_prompt, raw=True, options=options)
    assert reply.done
    client.delete("short-ctx")


def test_cli_create_with_an_adapter_applies_the_lora(server: Server, client: ollama.Client, tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "base.gguf")
    write_tiny_lora(tmp_path / "lora.gguf", tmp_path / "base.gguf")
    (tmp_path / "Base").write_text("FROM ./base.gguf\n")
    (tmp_path / "Adapted").write_text("FROM ./base.gguf\nADAPTER ./lora.gguf\n")
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}
    for name, modelfile in (("tiny-base", "Base"), ("tiny-lora", "Adapted")):
        created = subprocess.run([sys.executable, "-m", "lmserve", "create", name, "-f", str(tmp_path / modelfile)],
                                 env=env, capture_output=True, text=True, timeout=120, check=False)
        assert created.returncode == 0, created.stderr
    shown = parse_modelfile(client.show("tiny-lora").modelfile or "")
    assert len(shown.adapters) == 1 and not parse_modelfile(client.show("tiny-base").modelfile or "").adapters
    options = {"temperature": 0, "num_predict": 8}
    outputs = {name: client.generate(model=name, prompt="hello world", raw=True, options=options, keep_alive=0)
               for name in ("tiny-base", "tiny-lora")}
    assert all(reply.done and reply.eval_count for reply in outputs.values())
    assert outputs["tiny-base"].response != outputs["tiny-lora"].response
    again = client.generate(model="tiny-lora", prompt="hello world", raw=True, options=options, keep_alive=0)
    assert again.response == outputs["tiny-lora"].response
    client.delete("tiny-base")
    client.delete("tiny-lora")


def test_api_create_with_uploaded_weights_and_adapter(client: ollama.Client, tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "base.gguf")
    write_tiny_lora(tmp_path / "lora.gguf", tmp_path / "base.gguf")
    base, lora = client.create_blob(tmp_path / "base.gguf"), client.create_blob(tmp_path / "lora.gguf")
    assert client.create(model="api-lora", files={"base.gguf": base}, adapters={"lora.gguf": lora}).status == "success"
    shown = parse_modelfile(client.show("api-lora").modelfile or "")
    assert len(shown.adapters) == 1
    assert client.generate(model="api-lora", prompt="hi", raw=True, options={"num_predict": 2}, keep_alive=0).done
    client.delete("api-lora")


def test_quantizing_an_already_quantized_model_is_a_400_that_says_why(server: Server, client: ollama.Client,
                                                                       tmp_path: Path) -> None:
    reason = ("cannot quantize smollm2:135m to Q4_K_M: its weights are already quantized (Q4_1); "
              "quantize from an F32, F16 or BF16 GGUF")
    with pytest.raises(ollama.ResponseError) as info:
        client.create(model="smol-q4km", from_=MODEL, quantize="q4_K_M")
    assert (info.value.status_code, info.value.error) == (400, reason)
    (tmp_path / "Modelfile").write_text(f"FROM {MODEL}\n")
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}
    created = subprocess.run([sys.executable, "-m", "lmserve", "create", "smol-q4km", "-f",
                              str(tmp_path / "Modelfile"), "-q", "q4_K_M"],
                             env=env, capture_output=True, text=True, timeout=120, check=False)
    assert created.returncode == 1
    assert f"Error: {reason}" in created.stderr
    assert "smol-q4km:latest" not in names(client)


def test_the_removed_embedded_model_says_how_to_restore_it_and_pull_restores_it(server: Server,
                                                                                 client: ollama.Client) -> None:
    client.delete(MODEL)  # the model `serve` was started with, loaded and in use
    assert MODEL not in names(client)
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=MODEL, prompt="Hi", options={"num_predict": 2})
    assert info.value.status_code == 404
    assert "`lmserve pull smollm2:135m` restores it" in info.value.error
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}
    pulled = subprocess.run([sys.executable, "-m", "lmserve", "pull", MODEL], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert pulled.returncode == 0, pulled.stderr
    lines = [line.strip() for line in pulled.stderr.splitlines()]
    assert lines[0] == "pulling manifest" and "success" in lines
    assert MODEL in names(client)
    assert client.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}).done
    statuses = [part.status for part in client.pull(MODEL, stream=True)]  # again: nothing to do, still success
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
