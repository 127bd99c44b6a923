"""Signed models (lmserve/store/signatures.py): keys made in the test, tiny models signed with `lmserve sign` and the
module's `sign`, verified against the public key as a model enters the store: a changed, added or missing file, another
signer and a missing signature are refused under `require` naming the file and why, logged under `warn`, ignored
under `off`; a verified model's manifest and /api/show say who signed it and when, and it loads and answers on the
real llama.cpp engine."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from huggingface_hub import constants

from lmserve.config import ServerConfig
from lmserve.errors import InvalidRequest
from lmserve.http.app import create_app
from lmserve.server import build_service
from lmserve.store.signatures import Trust, check, sign, signature_path
from tests.hub import serve_hub, tiny_repository
from tests.tiny_lfm2 import write_tiny_lfm2


def write_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """A new P-256 key pair as PEM files: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("keys")
    return {name: write_keys(folder, name) for name in ("team", "stranger")}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_lfm2(path)
    return path


def repository(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def test_a_signed_directory_verifies_and_says_who_signed_it(tmp_path: Path, keys: dict) -> None:
    model = repository(tmp_path / "repo")
    assert sign(model, keys["team"][0]) == model / "model.sig"
    found = check(model, Trust("require", keys["team"][1]))
    assert set(found) == {"signed_by", "verified_at", "signature"} and found["signature"] == "model.sig"
    assert found["signed_by"].startswith("key sha256:") and len(found["signed_by"]) == len("key sha256:") + 64


@pytest.mark.parametrize(("change", "reason"), [
    (lambda m: (m / "model.safetensors").write_bytes(b"\1" * 64), "model.safetensors changed since it was signed"),
    (lambda m: (m / "extra.bin").write_bytes(b"x"), "Extra files found in model 'repo': extra.bin"),
    (lambda m: (m / "config.json").unlink(), "Missing files in model 'repo': config.json"),
], ids=["changed", "added", "missing"])
def test_a_changed_repository_is_refused_naming_the_file(tmp_path: Path, keys: dict, change, reason: str) -> None:
    model = repository(tmp_path / "repo")
    sign(model, keys["team"][0])
    change(model)
    with pytest.raises(InvalidRequest, match=r"^repo is refused \(--verify-signatures require\): its signature does "
                                             r"not verify: ") as refused:
        check(model, Trust("require", keys["team"][1]))
    assert reason in str(refused.value)


def test_another_signer_a_missing_signature_and_no_key_are_refused_under_require(
        tmp_path: Path, keys: dict, gguf: Path) -> None:
    copy = shutil.copy(gguf, tmp_path / "copy.gguf")
    with pytest.raises(InvalidRequest, match=r"copy.gguf is refused .*: it has no signature \(copy.gguf.sig"):
        check(Path(copy), Trust("require", keys["team"][1]))
    sign(Path(copy), keys["stranger"][0])
    assert signature_path(Path(copy)) == tmp_path / "copy.gguf.sig"
    with pytest.raises(InvalidRequest, match="Key mismatch"):
        check(Path(copy), Trust("require", keys["team"][1]))
    with pytest.raises(InvalidRequest, match="no --signature-key or --signature-certificate"):
        check(Path(copy), Trust("require"))


def test_warn_logs_what_require_refuses_and_off_checks_nothing(tmp_path: Path, keys: dict, gguf: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    copy = Path(shutil.copy(gguf, tmp_path / "copy.gguf"))
    sign(copy, keys["team"][0])
    with copy.open("ab") as tail:
        tail.write(b"\0")
    with caplog.at_level(logging.WARNING, logger="lmserve"):
        assert check(copy, Trust("warn", keys["team"][1])) == {}
    assert "copy.gguf: its signature does not verify: copy.gguf changed since it was signed" in caplog.text
    assert check(copy, Trust("off", keys["team"][1])) == {}
    caplog.clear()
    unsigned = Path(shutil.copy(gguf, tmp_path / "unsigned.gguf"))
    with caplog.at_level(logging.WARNING, logger="lmserve"):
        assert check(unsigned, Trust("warn", keys["team"][1])) == check(unsigned, Trust("warn")) == {}
    assert caplog.text == ""  # most models come without a signature: nothing to say about it


def test_lmserve_sign_signs_a_file_for_the_public_key(tmp_path: Path, keys: dict, gguf: Path) -> None:
    copy = Path(shutil.copy(gguf, tmp_path / "copy.gguf"))
    done = subprocess.run([sys.executable, "-m", "lmserve", "sign", str(copy), "--key", str(keys["team"][0])],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, f"signed {copy}: {copy}.sig"), done.stderr
    assert check(copy, Trust("require", keys["team"][1]))["signature"] == "copy.gguf.sig"
    missing = subprocess.run([sys.executable, "-m", "lmserve", "sign", str(tmp_path / "nope.gguf"), "--key",
                              str(keys["team"][0])], capture_output=True, text=True, timeout=120, check=False)
    assert (missing.returncode, missing.stderr.strip()) == (1, f"lmserve: model {tmp_path / 'nope.gguf'} not found")


@pytest.mark.asyncio
async def test_the_server_refuses_a_tampered_model_and_serves_the_signed_one(
        tmp_path: Path, keys: dict, gguf: Path) -> None:
    signed, tampered = Path(shutil.copy(gguf, tmp_path / "signed.gguf")), Path(shutil.copy(gguf, tmp_path / "t.gguf"))
    for path in (signed, tampered):
        sign(path, keys["team"][0])
    with tampered.open("r+b") as weights:
        weights.seek(-8, 2)
        weights.write(b"\1" * 8)
    config = ServerConfig(models_dir=str(tmp_path / "store"), ctx_size=512, parallel=1, threads=1,
                          verify_signatures="require", signature_key=str(keys["team"][1]))
    service, _ = build_service(config)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, config)),
                                     base_url="http://test", timeout=120) as client:
            refused = await client.post("/api/create", json={"model": "bad", "modelfile": f"FROM {tampered}",
                                                             "stream": False})
            assert refused.status_code == 400
            assert refused.json()["error"] == ("t.gguf is refused (--verify-signatures require): its signature does "
                                               "not verify: t.gguf changed since it was signed")
            created = await client.post("/api/create", json={"model": "good", "modelfile": f"FROM {signed}",
                                                             "stream": False})
            assert created.status_code == 200, created.text
            shown = (await client.post("/api/show", json={"model": "good"})).json()["signature"]
            assert shown["signed_by"] == check(signed, Trust("require", keys["team"][1]))["signed_by"]
            reply = await client.post("/api/chat", json={"model": "good", "stream": False, "options": {
                "num_predict": 2}, "messages": [{"role": "user", "content": "Hi"}]})
            assert reply.status_code == 200 and reply.json()["eval_count"] == 2
            assert (await client.get("/api/tags")).json()["models"][0]["name"].startswith("good")
    finally:
        service.close()


@pytest.mark.asyncio
async def test_a_pull_brings_the_signature_with_the_model_and_a_forged_one_is_refused(
        tmp_path: Path, keys: dict, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub repo's `FILE.sig` comes beside its GGUF, a repository's `model.sig` with every file it covers (the
    README a pull leaves out otherwise); each verifies as it enters the store."""
    model = Path(shutil.copy(gguf, tmp_path / "tiny-Q8_0.gguf"))
    signature = sign(model, keys["team"][0]).read_bytes()
    forged = bytearray(model.read_bytes())
    forged[-8:] = b"\1" * 8
    folder = tmp_path / "repository"
    for name, data in tiny_repository().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    repository_files = {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*")
                        if path.is_file()}
    repos = {"org/signed-GGUF": {model.name: model.read_bytes(), f"{model.name}.sig": signature},
             "org/forged-GGUF": {model.name: bytes(forged), f"{model.name}.sig": signature},
             "org/signed": {**repository_files, "model.sig": sign(folder, keys["team"][0]).read_bytes()}}
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once at import; the suite may have set it
    with serve_hub(repos) as hub:
        config = ServerConfig(models_dir=str(tmp_path / "store"), verify_signatures="require", hf_endpoint=hub.endpoint,
                              signature_key=str(keys["team"][1]))
        service, _ = build_service(config)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, config)),
                                         base_url="http://test", timeout=120) as client:
                async def pull(name: str) -> httpx.Response:
                    return await client.post("/api/pull", json={"model": name, "stream": False})

                forged_pull = await pull("hf.co/org/forged-GGUF:Q8_0")
                assert forged_pull.status_code == 400
                assert "tiny-Q8_0.gguf changed since it was signed" in forged_pull.json()["error"]
                for name in ("hf.co/org/signed-GGUF:Q8_0", "hf.co/org/signed:latest"):
                    assert (await pull(name)).json() == {"status": "success"}, name
                    shown = (await client.post("/api/show", json={"model": name})).json()
                    assert shown["signature"]["signed_by"].startswith("key sha256:"), name
        finally:
            service.close()
