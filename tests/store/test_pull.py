"""Spec for lmserve.store.pull: choosing the GGUF of a hub repo, and pulling it from a fake hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants

from lmserve.errors import InvalidRequest, LmserveError, ModelNotFound
from lmserve.store.names import parse_name
from lmserve.store.pull import PulledFiles, PulledRepository, PullProgress, available_quants, choose_files, pull
from lmserve.store.repository import repository_files
from tests.hub import FakeHub, serve_hub, sha256_hex, tiny_repository

REPO = [
    "README.md",
    "model-BF16.gguf",
    "model-F16.gguf",
    "model-Q4_0.gguf",
    "model-Q4_K_M.gguf",
    "model-Q4_K_S.gguf",
    "model-Q8_0.gguf",
    "mmproj-model-F16.gguf",
    "mmproj-model-Q8_0.gguf",
]


@pytest.mark.parametrize(
    ("filenames", "quant", "expected"),
    [
        (REPO, None, ("model-Q4_K_M.gguf", "mmproj-model-F16.gguf")),
        (REPO, "latest", ("model-Q4_K_M.gguf", "mmproj-model-F16.gguf")),
        (REPO, "q8_0", ("model-Q8_0.gguf", "mmproj-model-Q8_0.gguf")),
        (REPO, "Q4_K_S", ("model-Q4_K_S.gguf", "mmproj-model-F16.gguf")),
        (REPO, "F16", ("model-F16.gguf", "mmproj-model-F16.gguf")),
        (REPO, "bf16", ("model-BF16.gguf", "mmproj-model-F16.gguf")),
        (["a-Q8_0.gguf", "a-Q4_0.gguf", "a-F16.gguf"], None, ("a-Q4_0.gguf", None)),
        (["a-Q8_0.gguf", "a-F16.gguf"], None, ("a-Q8_0.gguf", None)),
        (["a-F32.gguf", "a-F16.gguf"], None, ("a-F16.gguf", None)),
        (["b-IQ3_XXS.gguf", "a-Q6_K.gguf"], None, ("a-Q6_K.gguf", None)),
        (["model.gguf"], None, ("model.gguf", None)),
        (["model.gguf", "mmproj-x-BF16.gguf", "mmproj-x-F32.gguf"], None, ("model.gguf", "mmproj-x-BF16.gguf")),
        (["m.Q4_K_M.gguf", "IQ4_XS/m.gguf", "sub/m.Q4_K_M.gguf"], "Q4_K_M", ("m.Q4_K_M.gguf", None)),
        (["m-UD-Q4_K_XL.gguf"], "q4_k_xl", ("m-UD-Q4_K_XL.gguf", None)),
        (["M-Q4_K_M.GGUF"], None, ("M-Q4_K_M.GGUF", None)),
    ],
)
def test_choose_files(filenames: list[str], quant: str | None, expected: tuple[str, str | None]) -> None:
    assert choose_files(filenames, quant) == expected


@pytest.mark.parametrize(
    ("filenames", "quant", "code", "mentions"),
    [
        (["README.md", "config.json"], None, "no_gguf", []),
        (["mmproj-F16.gguf"], None, "no_gguf", []),
        ([], "Q4_K_M", "no_gguf", []),
        (REPO, "Q4_K", "quant_not_found", ["BF16", "F16", "Q4_0", "Q4_K_M", "Q4_K_S", "Q8_0"]),
        (["a-BF16.gguf"], "F16", "quant_not_found", ["BF16"]),
        (["a-IQ4_XS.gguf"], "Q4_XS", "quant_not_found", ["IQ4_XS"]),
        (["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"], None, "split_gguf", ["Q4_K_M"]),
    ],
)
def test_choose_files_refuses(filenames: list[str], quant: str | None, code: str, mentions: list[str]) -> None:
    with pytest.raises(InvalidRequest) as info:
        choose_files(filenames, quant)
    assert info.value.status == 400
    assert info.value.code == code
    assert info.value.param == "model"
    for label in mentions:
        assert label in info.value.message


def test_available_quants_keeps_order_and_falls_back_to_file_name() -> None:
    assert available_quants(["a-Q8_0.gguf", "b-q8_0.gguf", "model.gguf"]) == ["Q8_0", "model.gguf"]


# --- pulling from a fake hub ---------------------------------------------------------------------------------


def fake_gguf(label: str, size: int = 3000) -> bytes:
    """Bytes that look like the start of a GGUF; never loaded by llama.cpp."""
    seed = hashlib.sha256(label.encode()).digest()
    return b"GGUF" + (seed * (size // len(seed) + 1))[: size - 4]


FILES = {
    "README.md": b"# tiny\n",
    "tiny-Q4_K_M.gguf": fake_gguf("q4km"),
    "tiny-Q8_0.gguf": fake_gguf("q80", 5000),
    "mmproj-tiny-F16.gguf": fake_gguf("mmproj", 2000),
}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once at import; the suite may have set it
    repos = {"org/tiny-GGUF": FILES, "org/docs": {"README.md": b"no weights here"}, "org/gated": FILES,
             "org/tiny": REPOSITORY, "org/tiny-sharded": SHARDED, "org/bin-only": {"config.json": b"{}",
                                                                                  "pytorch_model.bin": b"x"}}
    with serve_hub(repos, gated=frozenset({"org/gated"})) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield fake


REPOSITORY = tiny_repository()
SHARDED = tiny_repository(shards=2)


def pull_from(hub: FakeHub, cache: Path, text: str, events: list[PullProgress] | None = None) -> PulledFiles:
    pulled = pull_any(hub, cache, text, events)
    assert isinstance(pulled, PulledFiles)
    return pulled


def pull_repo(hub: FakeHub, cache: Path, text: str, events: list[PullProgress] | None = None) -> PulledRepository:
    pulled = pull_any(hub, cache, text, events)
    assert isinstance(pulled, PulledRepository)
    return pulled


def pull_any(
    hub: FakeHub, cache: Path, text: str, events: list[PullProgress] | None = None
) -> PulledFiles | PulledRepository:
    sink = events.append if events is not None else (lambda p: None)
    return pull(parse_name(text), endpoint=hub.endpoint, cache_dir=cache, progress=sink)


def test_pull_downloads_the_quant_and_projector_and_verifies_them(hub: FakeHub, tmp_path: Path) -> None:
    events: list[PullProgress] = []
    pulled = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:q8_0", events)

    model, projector = FILES["tiny-Q8_0.gguf"], FILES["mmproj-tiny-F16.gguf"]
    assert pulled.model.read_bytes() == model
    assert pulled.model.name == "tiny-Q8_0.gguf"
    assert pulled.model.resolve().is_relative_to((tmp_path / "cache").resolve())
    assert pulled.model_sha256 == sha256_hex(model)
    assert pulled.projector is not None
    assert pulled.projector.read_bytes() == projector
    assert pulled.projector_sha256 == sha256_hex(projector)

    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert "success" not in statuses  # the caller registers the files, then says success
    model_events = [e for e in events if e.status == "pulling tiny-Q8_0.gguf"]
    assert model_events[0].completed == 0
    assert model_events[-1].completed == model_events[-1].total == len(model)
    assert {e.digest for e in model_events} == {f"sha256:{sha256_hex(model)}"}
    assert statuses.count("verifying sha256 digest") == 2
    assert statuses.index("pulling tiny-Q8_0.gguf") < statuses.index("pulling mmproj-tiny-F16.gguf")


def test_pull_without_tag_prefers_q4_k_m(hub: FakeHub, tmp_path: Path) -> None:
    pulled = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF")
    assert pulled.model.name == "tiny-Q4_K_M.gguf"
    assert pulled.model_sha256 == sha256_hex(FILES["tiny-Q4_K_M.gguf"])


def test_second_pull_uses_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    first = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")
    num_downloads = len(hub.requests_for(first.model_sha256))
    second = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")
    assert second == first
    assert len(hub.requests_for(first.model_sha256)) == num_downloads == 1


def test_pull_resumes_a_partial_download(hub: FakeHub, tmp_path: Path) -> None:
    data = FILES["tiny-Q4_K_M.gguf"]
    digest = sha256_hex(data)
    blobs = tmp_path / "cache" / "models--org--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{digest}.partial").write_bytes(data[:1000])
    events: list[PullProgress] = []

    pulled = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M", events)

    assert pulled.model.read_bytes() == data
    [download] = hub.requests_for(f"/cdn/{digest}")
    assert download.headers["range"] == "bytes=1000-"
    first = next(e for e in events if e.status == "pulling tiny-Q4_K_M.gguf")
    assert (first.completed, first.total) == (1000, len(data))
    assert not (blobs / f"{digest}.partial").exists()


def test_a_server_that_ignores_the_range_rewrites_the_partial_file(hub: FakeHub, tmp_path: Path) -> None:
    data = FILES["tiny-Q4_K_M.gguf"]
    blobs = tmp_path / "cache" / "models--org--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha256_hex(data)}.partial").write_bytes(data[:1000])
    hub.honours_range = False

    pulled = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")

    assert pulled.model.read_bytes() == data  # not the first 1000 bytes twice


def test_a_download_that_stops_short_fails_and_the_next_pull_resumes_it(hub: FakeHub, tmp_path: Path) -> None:
    data = FILES["tiny-Q4_K_M.gguf"]
    digest = sha256_hex(data)
    hub.cut_after = 1000
    with pytest.raises(LmserveError, match=f"stopped at 1000 of {len(data)} bytes; pull again to resume"):
        pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")
    hub.cut_after = None

    pulled = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")

    assert pulled.model.read_bytes() == data
    assert hub.requests_for(f"/cdn/{digest}")[-1].headers["range"] == "bytes=1000-"


def test_corrupt_partial_is_refused_then_pulled_again(hub: FakeHub, tmp_path: Path) -> None:
    data = FILES["tiny-Q4_K_M.gguf"]
    blobs = tmp_path / "cache" / "models--org--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha256_hex(data)}.partial").write_bytes(b"X" * 1000)

    with pytest.raises(LmserveError) as info:
        pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")
    assert info.value.code == "digest_mismatch"
    assert info.value.status == 500

    pulled = pull_from(hub, tmp_path / "cache", "hf.co/org/tiny-GGUF:Q4_K_M")
    assert pulled.model.read_bytes() == data


def test_fake_hub_speaks_enough_hub_for_huggingface_hub(hub: FakeHub) -> None:
    api = HfApi(endpoint=hub.endpoint)
    assert sorted(api.list_repo_files("org/tiny-GGUF")) == sorted(FILES)
    info = api.model_info("org/tiny-GGUF", files_metadata=True)
    [sibling] = [s for s in info.siblings or [] if s.rfilename == "tiny-Q8_0.gguf"]
    assert sibling.lfs is not None
    assert (sibling.size, sibling.lfs.sha256) == (len(FILES["tiny-Q8_0.gguf"]), sha256_hex(FILES["tiny-Q8_0.gguf"]))


def test_pull_sends_the_token(hub: FakeHub, tmp_path: Path) -> None:
    pull(parse_name("hf.co/org/tiny-GGUF:Q4_K_M"), endpoint=hub.endpoint, token="hf_secret", cache_dir=tmp_path)
    [info] = hub.requests_for("/api/models/org/tiny-GGUF")
    assert info.headers["authorization"] == "Bearer hf_secret"
    [download] = hub.requests_for(f"/cdn/{sha256_hex(FILES['tiny-Q4_K_M.gguf'])}")
    assert "authorization" not in download.headers  # the CDN is another origin: the token stays on the hub


@pytest.mark.parametrize(
    ("name", "error", "status", "code"),
    [
        ("hf.co/org/missing", ModelNotFound, 404, "model_not_found"),
        ("hf.co/org/docs", InvalidRequest, 400, "no_weights"),
        ("org/bin-only", InvalidRequest, 400, "no_weights"),
        ("org/tiny:Q4_K_M", InvalidRequest, 400, "quant_not_found"),
        ("org/missing", ModelNotFound, 404, "model_not_found"),
        ("hf.co/org/gated", InvalidRequest, 400, "gated_repo"),
        ("hf.co/org/tiny-GGUF:Q2_K", InvalidRequest, 400, "quant_not_found"),
        ("smollm2:135m", InvalidRequest, 400, None),
    ],
)
def test_pull_errors(
    hub: FakeHub, tmp_path: Path, name: str, error: type[LmserveError], status: int, code: str | None
) -> None:
    with pytest.raises(error) as info:
        pull_from(hub, tmp_path / "cache", name)
    assert type(info.value) is error
    assert info.value.status == status
    assert info.value.code == code


def test_an_org_repo_name_pulls_from_the_hub_too(hub: FakeHub, tmp_path: Path) -> None:
    pulled = pull_from(hub, tmp_path / "cache", "org/tiny-GGUF:q8_0")
    assert pulled.model.name == "tiny-Q8_0.gguf"


# --- pulling a safetensors repository --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "files"), [("org/tiny", REPOSITORY), ("hf.co/org/tiny", REPOSITORY),
                                             ("org/tiny-sharded", SHARDED)])
def test_pull_of_a_repository_downloads_its_files_and_verifies_them(
    hub: FakeHub, tmp_path: Path, text: str, files: dict[str, bytes]
) -> None:
    events: list[PullProgress] = []
    pulled = pull_repo(hub, tmp_path / "cache", text, events)

    kept = repository_files(files)
    assert sorted(p.name for p in pulled.directory.iterdir()) == sorted(kept)  # README, *.bin, folders: left out
    assert pulled.directory.resolve().is_relative_to((tmp_path / "cache").resolve())
    for name in kept:
        assert (pulled.directory / name).read_bytes() == files[name]
        assert pulled.sha256[name] == sha256_hex(files[name])
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    pulled_in_order = dict.fromkeys(s.removeprefix("pulling ") for s in statuses if s.startswith("pulling "))
    assert list(pulled_in_order)[1:] == kept  # after "manifest": one file after another, config.json first
    assert statuses.count("verifying sha256 digest") == len(kept)
    weights = [e for e in events if e.status.endswith(".safetensors")]
    assert weights[-1].completed == weights[-1].total and weights[-1].digest is not None  # LFS: a sha256
    config = [e for e in events if e.status == "pulling config.json"]
    assert config[-1].completed == len(files["config.json"]) and config[-1].digest is None  # not LFS: no sha256
    assert not [r for r in hub.requests if r.path.endswith(("README.md", ".bin", ".png", "params.json"))]


def test_second_pull_of_a_repository_downloads_nothing(hub: FakeHub, tmp_path: Path) -> None:
    first = pull_repo(hub, tmp_path / "cache", "org/tiny")
    before = len(hub.requests)
    second = pull_repo(hub, tmp_path / "cache", "org/tiny")
    assert second == first
    assert [r for r in hub.requests[before:] if r.method == "GET" and "/api/" not in r.path] == []


def test_a_repository_download_that_stops_short_resumes(hub: FakeHub, tmp_path: Path) -> None:
    data = REPOSITORY["model.safetensors"]
    hub.cut_after = 100
    with pytest.raises(LmserveError, match=f"stopped at 100 of {len(data)} bytes; pull again to resume"):
        pull_repo(hub, tmp_path / "cache", "org/tiny")
    hub.cut_after = None

    pulled = pull_repo(hub, tmp_path / "cache", "org/tiny")

    assert (pulled.directory / "model.safetensors").read_bytes() == data
    assert hub.requests_for(f"/cdn/{sha256_hex(data)}")[-1].headers["range"] == "bytes=100-"


def test_a_repository_file_with_the_wrong_sha256_fails_then_pulls_again(hub: FakeHub, tmp_path: Path) -> None:
    data = REPOSITORY["model.safetensors"]
    blobs = tmp_path / "cache" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha256_hex(data)}.partial").write_bytes(b"X" * 100)

    with pytest.raises(LmserveError) as info:
        pull_repo(hub, tmp_path / "cache", "org/tiny")
    assert (info.value.code, info.value.status) == ("digest_mismatch", 500)
    assert "model.safetensors" in info.value.message

    pulled = pull_repo(hub, tmp_path / "cache", "org/tiny")
    assert (pulled.directory / "model.safetensors").read_bytes() == data


def test_a_small_file_of_the_wrong_size_fails(hub: FakeHub, tmp_path: Path) -> None:
    hub.listed_sizes["tokenizer.json"] = 3
    with pytest.raises(LmserveError, match=r"size mismatch for tokenizer\.json") as info:
        pull_repo(hub, tmp_path / "cache", "org/tiny")
    assert info.value.code == "digest_mismatch"
    hub.listed_sizes.clear()
    pulled = pull_repo(hub, tmp_path / "cache", "org/tiny")
    assert (pulled.directory / "tokenizer.json").read_bytes() == REPOSITORY["tokenizer.json"]


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("no-such-host.invalid", "name resolution failed (are you offline? set HF_ENDPOINT for a mirror)"),
        (None, "connection refused (is HF_ENDPOINT right?)"),  # a port nobody listens on
    ],
)
def test_an_unreachable_hub_is_named_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str | None, reason: str
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with serve_hub({}) as fake:
        endpoint = fake.endpoint  # the port is free again once the server stops
    if host is not None:
        endpoint = f"http://{host}"
    with pytest.raises(LmserveError) as info:
        pull(parse_name("hf.co/org/tiny-GGUF"), endpoint=endpoint, cache_dir=tmp_path)
    assert (info.value.status, info.value.code) == (502, "hub_unreachable")
    assert info.value.message == f"could not reach the hub at {endpoint}: {reason}"
    assert "Errno" not in info.value.message
    assert os.listdir(tmp_path) == []
