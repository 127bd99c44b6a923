"""Spec for lmserve.store.store: digests, blobs, manifests, list/get/find/copy/delete, gc, embedded model, races."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import random
import threading
from pathlib import Path

import pytest

import lmserve.store.atomic_files as atomic_files
import lmserve.store.store as store_module
from lmserve.errors import InvalidRequest, LmserveError, ModelNotFound
from lmserve.store.manifest import DIGEST_RE, Manifest, check_digest
from lmserve.store.names import ModelName, parse_name
from lmserve.store.store import Store

HEX = "ab" * 32


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def temp_files(root: Path) -> list[Path]:
    return [path for path in root.rglob(".tmp-*")]


def manifest_files(store: Store) -> list[Path]:
    return [path for path in (store.root / "manifests").rglob("*") if path.is_file()]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


def add(store: Store, data: bytes) -> str:
    return store.add_blob(io.BytesIO(data))


def model(store: Store, text: str, data: bytes = b"weights", **fields: object) -> ModelName:
    name = parse_name(text)
    store.save(name, Manifest(model=add(store, data), **fields))  # type: ignore[arg-type]
    return name


# digests


@pytest.mark.parametrize("digest", ["sha256:" + HEX, "sha256:" + "0" * 64, digest_of(b"")])
def test_valid_digests_pass(digest: str) -> None:
    assert check_digest(digest) == digest
    assert DIGEST_RE.match(digest)


@pytest.mark.parametrize(
    ("digest", "rule"),
    [
        ("", "starts with 'sha256:'"),
        (HEX, "starts with 'sha256:'"),
        ("sha512:" + HEX, "starts with 'sha256:'"),
        ("sha256-" + HEX, "starts with 'sha256:'"),
        ("SHA256:" + HEX, "starts with 'sha256:'"),
        ("../sha256:" + HEX, "starts with 'sha256:'"),
        ("sha256:" + HEX.upper(), "lowercase"),
        ("sha256:" + HEX[:-1] + "g", "lowercase"),
        ("sha256:" + HEX[:-2] + "/.", "lowercase"),
        ("sha256:abc", "exactly 64 hex digits"),
        ("sha256:" + HEX + "0", "exactly 64 hex digits"),
        ("sha256:" + HEX + "\n", "exactly 64 hex digits"),
        ("sha256:../../etc/passwd", "exactly 64 hex digits"),
    ],
)
def test_bad_digests_are_rejected_naming_the_rule(store: Store, digest: str, rule: str) -> None:
    assert not DIGEST_RE.match(digest)
    for call in (check_digest, store.blob_path, store.has_blob):
        with pytest.raises(InvalidRequest, match=rule) as caught:
            call(digest)
        assert caught.value.param == "digest"
        assert caught.value.status == 400


def test_blob_path_stays_in_blobs(store: Store) -> None:
    path = store.blob_path("sha256:" + HEX)
    assert path.parent == store.root / "blobs"
    assert path.name == "sha256-" + HEX


# blobs


def test_add_blob_from_stream_and_path(store: Store, tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)  # several chunks
    digest = store.add_blob(io.BytesIO(data), expected=digest_of(data))
    assert digest == digest_of(data)
    assert store.blob_path(digest).read_bytes() == data
    source = tmp_path / "file.bin"
    source.write_bytes(b"from a path")
    assert store.add_blob(source) == digest_of(b"from a path")
    assert store.add_blob(io.BytesIO(data)) == digest  # again: same blob, no temp left
    assert store.has_blob(digest)
    assert not temp_files(store.root)


def test_add_blob_digest_mismatch_leaves_nothing(store: Store) -> None:
    claimed = digest_of(b"other bytes")
    with pytest.raises(InvalidRequest, match="digest mismatch") as caught:
        store.add_blob(io.BytesIO(b"these bytes"), expected=claimed)
    assert caught.value.code == "digest_mismatch"
    assert list((store.root / "blobs").iterdir()) == []


def test_add_blob_checks_expected_before_reading(store: Store) -> None:
    stream = io.BytesIO(b"data")
    with pytest.raises(InvalidRequest, match="sha256:"):
        store.add_blob(stream, expected="sha256:../x")
    assert stream.tell() == 0
    assert list((store.root / "blobs").iterdir()) == []


def test_import_file_through_a_relative_symlink_stores_the_target(store: Store, tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "etag").write_bytes(b"bytes")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "config.json").symlink_to("../blobs/etag")  # as in the hub cache
    digest = store.import_file(tmp_path / "snapshot" / "config.json")
    assert store.blob_path(digest).read_bytes() == b"bytes"
    assert not store.blob_path(digest).is_symlink()


def test_import_file_rejects_a_missing_file(store: Store, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="not a file"):
        store.import_file(tmp_path / "missing.gguf")


# manifests


def test_save_get_round_trips_every_field(store: Store) -> None:
    weights, projector, adapter = add(store, b"w"), add(store, b"p"), add(store, b"a")
    manifest = Manifest(
        model=weights,
        projector=projector,
        adapters=[adapter],
        template="{{ .Prompt }}",
        system="be brief",
        parameters={"temperature": 0.1, "stop": ["<|im_end|>"], "num_ctx": 2048},
        messages=[("user", "hi"), ("assistant", "hello")],
        license=["MIT"],
        parent="base:latest",
        details={"format": "gguf", "family": "llama", "families": ["llama"]},
        files={"config.json": weights, "tokenizer/vocab.txt": add(store, b"v")},
    )
    name = parse_name("me/custom:v1")
    store.save(name, manifest)
    assert manifest.modified_at > 0
    entry = store.get(name)
    assert entry.name == name
    assert entry.manifest == manifest
    assert entry.size == 4  # each blob once
    assert len(entry.digest) == 64
    assert entry.digest == hashlib.sha256(store._manifest_path(name).read_bytes()).hexdigest()


def test_save_refuses_missing_blobs_and_bad_digests(store: Store) -> None:
    with pytest.raises(InvalidRequest, match="missing") as caught:
        store.save(parse_name("m"), Manifest(model="sha256:" + HEX))
    assert caught.value.code == "blob_missing"
    with pytest.raises(InvalidRequest, match="starts with 'sha256:'"):
        store.save(parse_name("m"), Manifest(model=add(store, b"w"), adapters=["../../x"]))
    assert store.list() == []


def test_find_defaults_the_tag_and_get_raises_404(store: Store) -> None:
    name = model(store, "llama3")
    assert store.find("llama3").name == name
    assert store.find("llama3:latest").name == name
    for text in ("llama3:8b", "other"):
        with pytest.raises(ModelNotFound) as caught:
            store.find(text)
        assert caught.value.status == 404


@pytest.mark.parametrize(
    ("stored", "asked", "message"),
    [
        ([], "gpt-4o", "model 'gpt-4o' not found (available: none)"),
        (["llama3", "qwen:7b"], "gpt-4o", "model 'gpt-4o' not found (available: qwen:7b, llama3:latest)"),
        (["llama3"], "llama3:8b", "model 'llama3:8b' not found (available: llama3:latest)"),
        ([f"m{i}" for i in range(7)], "x",
         "model 'x' not found (available: m6:latest, m5:latest, m4:latest, m3:latest, m2:latest and 2 more; "
         "see GET /v1/models)"),
        (["llama3"], "smollm2:135m", "model 'smollm2:135m' not found: it was removed; `lmserve pull smollm2:135m` "
         "restores it (available: llama3:latest)"),
    ],
)  # fmt: skip
def test_find_names_the_model_as_written_and_what_exists(
    store: Store, monkeypatch: pytest.MonkeyPatch, stored: list[str], asked: str, message: str
) -> None:
    clock = itertools.count(1000)
    monkeypatch.setattr(store_module.time, "time", lambda: float(next(clock)))
    for i, text in enumerate(stored):
        model(store, text, data=b"weights %d" % i)
    with pytest.raises(ModelNotFound) as caught:
        store.find(asked)
    assert (caught.value.message, caught.value.name, caught.value.param) == (message, asked, "model")


def test_list_is_newest_first(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(1000)
    monkeypatch.setattr(store_module.time, "time", lambda: float(next(clock)))
    for text in ("a", "b", "c"):
        model(store, text)
    model(store, "a")  # saved again: newest
    assert [str(entry.name) for entry in store.list()] == ["a:latest", "c:latest", "b:latest"]


def test_copy_shares_blobs(store: Store) -> None:
    source = model(store, "base:1", system="hi")
    destination = parse_name("ns/copy:2")
    store.copy(source, destination)
    assert store.get(destination).manifest.system == "hi"
    assert store.get(destination).manifest.model == store.get(source).manifest.model
    assert len(list((store.root / "blobs").iterdir())) == 1
    with pytest.raises(ModelNotFound):
        store.copy(parse_name("missing"), parse_name("x"))


def test_delete_removes_the_model_and_its_empty_directories(store: Store) -> None:
    name = model(store, "ns/solo:1")
    store.delete(name)
    assert store.list() == []
    assert list((store.root / "manifests").iterdir()) == []
    assert list((store.root / "blobs").iterdir()) == []
    with pytest.raises(ModelNotFound):
        store.delete(name)


def test_shared_blob_goes_with_the_last_model(store: Store) -> None:
    first = model(store, "first", b"shared")
    second = model(store, "second", b"shared", adapters=[add(store, b"lora")])
    shared, lora = digest_of(b"shared"), digest_of(b"lora")
    store.delete(second)
    assert store.has_blob(shared)
    assert not store.has_blob(lora)
    assert [entry.name for entry in store.list()] == [first]
    store.delete(first)
    assert not store.has_blob(shared)


@pytest.mark.parametrize(
    ("text", "relative"),
    [
        ("smollm2:135m", "local/library/smollm2/135m"),
        ("plain", "local/library/plain/latest"),
        ("LiquidAI/lfm2:1.2b", "local/LiquidAI/lfm2/1.2b"),
        ("hf.co/LiquidAI/LFM2-1.2B-GGUF:q4_k_m", "hf.co/LiquidAI/LFM2-1.2B-GGUF/Q4_K_M"),
        ("hf.co/org/repo", "hf.co/org/repo/latest"),
    ],
)
def test_names_round_trip_through_the_manifest_path(store: Store, text: str, relative: str) -> None:
    name = model(store, text)
    assert manifest_files(store) == [store.root / "manifests" / relative]
    assert [entry.name for entry in store.list()] == [name]
    assert store.find(str(name)).name == name


@pytest.mark.parametrize(
    "name",
    [
        ModelName(None, None, "..", "latest"),
        ModelName(None, "..", "x", "latest"),
        ModelName(None, None, "x", "../../etc"),
        ModelName(None, None, "a/b", "latest"),
        ModelName(None, None, "/etc/passwd", "latest"),
        ModelName("evil.com", "org", "repo", "latest"),
        ModelName("hf.co", "org", "repo", "q4_k_m"),  # hub tags are upper-case
        ModelName(None, None, "x", ""),
        ModelName(None, None, "x y", "latest"),
    ],
)
def test_non_canonical_or_traversing_names_are_rejected(store: Store, name: ModelName) -> None:
    digest = add(store, b"w")
    calls = [lambda: store.save(name, Manifest(model=digest)), lambda: store.get(name), lambda: store.delete(name)]
    calls.append(lambda: store.copy(parse_name("x"), name))
    for call in calls:
        with pytest.raises(InvalidRequest) as caught:
            call()
        assert caught.value.param == "model"
    assert manifest_files(store) == []


@pytest.mark.parametrize("text", ["../x", "/abs/path", "a/../../b", "x:..", "C:\\x", "model.gguf", "a b"])
def test_find_rejects_traversal_text(store: Store, text: str) -> None:
    with pytest.raises(InvalidRequest):
        store.find(text)


# failure modes


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"[]",
        b'{"model": "sha256:../../x"}',
        b'{"model": 5}',
        b'{"messages": [["user"]], "model": "sha256:' + HEX.encode() + b'"}',
        b"\xff\xfe",
        b"[" * 100_000,
    ],
)
def test_corrupt_manifests_are_skipped_by_list(store: Store, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    good = model(store, "good")
    bad = store._manifest_path(parse_name("bad"))
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="lmserve.store.store"):
        assert [entry.name for entry in store.list()] == [good]
    assert "bad:latest" in caplog.text
    with pytest.raises(LmserveError) as caught:
        store.find("bad")
    assert caught.value.status == 500
    store.delete(parse_name("bad"))  # a corrupt model can still be removed


def test_a_model_with_a_missing_blob_is_not_listed(store: Store) -> None:
    name = model(store, "m", b"w")
    store.blob_path(digest_of(b"w")).unlink()
    assert store.list() == []
    with pytest.raises(LmserveError, match="missing"):
        store.get(name)


def test_gc_keeps_blobs_a_corrupt_manifest_mentions(store: Store) -> None:
    digest = add(store, b"w")
    bad = store._manifest_path(parse_name("bad"))
    bad.parent.mkdir(parents=True)
    bad.write_text('{"model": "' + digest + '", trunc')
    assert store.gc() == 0
    assert store.has_blob(digest)


def test_a_crash_during_save_lists_nothing_and_leaves_no_temp(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = add(store, b"w")

    def crash(*args: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(store_module.os, "replace", crash)
    with pytest.raises(OSError, match="fire"):
        store.save(parse_name("m"), Manifest(model=digest))
    monkeypatch.undo()
    assert store.list() == []
    assert not temp_files(store.root)


def test_gc_removes_unreferenced_blobs_and_only_stale_temps(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    model(store, "kept", b"kept")
    orphan = add(store, b"orphan")
    fresh = store.root / "blobs" / ".tmp-upload"
    fresh.write_bytes(b"half")
    manifest_temp = store.root / "manifests" / "local" / "library" / "kept" / ".tmp-x"
    manifest_temp.write_bytes(b"{")
    foreign = store.root / "blobs" / "README"
    foreign.write_text("not a blob")
    assert [entry.name.name for entry in store.list()] == ["kept"]
    assert store.gc() == 1
    assert not store.has_blob(orphan)
    assert store.has_blob(digest_of(b"kept"))
    assert fresh.exists() and manifest_temp.exists() and foreign.exists()
    monkeypatch.setattr(atomic_files, "STALE_TEMP_SECONDS", -1.0)
    assert store.gc() == 2
    assert not temp_files(store.root)
    assert foreign.exists()


# repositories (config.json + safetensors + tokenizer files, one blob each)


REPO_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights",
              "tokenizer.json": b"{}"}  # fmt: skip


def repo_model(store: Store, text: str, files: dict[str, bytes] = REPO_FILES, **fields: object) -> ModelName:
    digests = {name: add(store, data) for name, data in files.items()}
    name = parse_name(text)
    store.save(name, Manifest(model=digests["config.json"], files=digests, **fields))  # type: ignore[arg-type]
    return name


def repo_dirs(store: Store) -> list[Path]:
    repos = store.root / "repos"
    return sorted(repos.iterdir()) if repos.exists() else []


def test_a_repository_lists_its_files_once_and_its_size(store: Store) -> None:
    entry = store.get(repo_model(store, "org/tiny"))
    assert entry.manifest.digests == [digest_of(data) for data in REPO_FILES.values()]
    assert entry.size == sum(len(data) for data in REPO_FILES.values())


def test_model_path_of_a_gguf_is_its_blob(store: Store) -> None:
    manifest = store.get(model(store, "g", b"gguf")).manifest
    assert store.model_path(manifest) == store.blob_path(digest_of(b"gguf"))
    assert repo_dirs(store) == []


def test_model_path_lays_out_a_repository_as_links_to_its_blobs(store: Store) -> None:
    files = {**REPO_FILES, "sub/extra.json": b"[]"}
    manifest = store.get(repo_model(store, "org/tiny", files)).manifest

    directory = store.model_path(manifest)

    assert directory.parent == store.root / "repos"
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()) == sorted(files)
    for name, data in files.items():
        link = directory / name
        assert link.is_symlink() and not Path(os.readlink(link)).is_absolute()
        assert link.resolve() == store.blob_path(digest_of(data)).resolve()
        assert link.read_bytes() == data
    assert not temp_files(store.root)


def test_model_path_is_made_once_and_repaired_when_broken(store: Store) -> None:
    manifest = store.get(repo_model(store, "org/tiny")).manifest
    directory = store.model_path(manifest)
    inode = directory.stat().st_ino
    assert store.model_path(manifest) == directory
    assert directory.stat().st_ino == inode  # reused, not made again
    (directory / "tokenizer.json").unlink()
    assert store.model_path(manifest) == directory
    assert (directory / "tokenizer.json").read_bytes() == b"{}"


def test_models_with_the_same_files_share_a_directory(store: Store) -> None:
    first = store.get(repo_model(store, "org/tiny", system="one")).manifest
    second = store.get(repo_model(store, "other", system="two")).manifest
    assert store.model_path(first) == store.model_path(second)
    third = store.get(repo_model(store, "org/more", {**REPO_FILES, "vocab.txt": b"a"})).manifest
    assert store.model_path(third) != store.model_path(first)


def test_copy_keeps_and_delete_of_the_last_drops_a_repositorys_blobs_and_directory(store: Store) -> None:
    source = repo_model(store, "org/tiny")
    store.copy(source, parse_name("mine"))
    directory = store.model_path(store.get(source).manifest)

    store.delete(source)
    assert directory.is_dir()
    assert all(store.has_blob(digest_of(data)) for data in REPO_FILES.values())
    assert store.model_path(store.get(parse_name("mine")).manifest) == directory

    store.delete(parse_name("mine"))
    assert repo_dirs(store) == []
    assert list((store.root / "blobs").iterdir()) == []


def test_gc_removes_directories_no_manifest_refers_to(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = store.model_path(store.get(repo_model(store, "kept")).manifest)
    orphan = store.root / "repos" / ("0" * 16)
    orphan.mkdir()
    (orphan / "config.json").symlink_to("../../blobs/nothing")
    fresh_temp = store.root / "repos" / ".tmp-half"
    fresh_temp.mkdir()
    assert store.gc() == 1
    assert repo_dirs(store) == [fresh_temp, kept]
    monkeypatch.setattr(atomic_files, "STALE_TEMP_SECONDS", -1.0)
    assert store.gc() == 1
    assert repo_dirs(store) == [kept]


def test_gc_keeps_every_directory_while_a_manifest_is_corrupt(store: Store) -> None:
    directory = store.model_path(store.get(repo_model(store, "kept")).manifest)
    bad = store._manifest_path(parse_name("bad"))
    bad.parent.mkdir(parents=True)
    bad.write_text('{"model": "sha256:' + HEX + '", trunc')
    store._manifest_path(parse_name("kept")).unlink()
    store.gc()
    assert repo_dirs(store) == [directory]


def test_an_old_manifest_without_files_loads(store: Store) -> None:
    digest = add(store, b"w")
    path = store._manifest_path(parse_name("old"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema_version": 1, "model": digest, "details": {"format": "gguf"},
                                "modified_at": 1.0}))
    manifest = store.find("old").manifest
    assert manifest.files == {}
    assert store.model_path(manifest) == store.blob_path(digest)


@pytest.mark.parametrize("files", [{"../escape": "sha256:" + HEX}, {"/abs": "sha256:" + HEX},
                                   {"config.json": "sha256:nope"}, {"config.json": 7}])
def test_a_manifest_with_bad_files_is_corrupt(store: Store, files: dict[str, object]) -> None:
    path = store._manifest_path(parse_name("bad"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model": add(store, b"w"), "files": files}))
    with pytest.raises(LmserveError, match="corrupt manifest"):
        store.get(parse_name("bad"))


# environment and the embedded model


def test_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Store.from_env({"LMSERVE_MODELS": str(tmp_path / "m")}).root == tmp_path / "m"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for env in ({}, {"LMSERVE_MODELS": ""}):
        store = Store.from_env(env)
        assert store.root == tmp_path / "home" / ".lmserve" / "models"
        assert (store.root / "blobs").is_dir() and (store.root / "manifests").is_dir()


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "embedded.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    return path


def test_ensure_embedded_hard_links_once(store: Store, gguf: Path) -> None:
    details = {"format": "gguf", "family": "llama", "parameter_size": "135M"}
    entry = store.ensure_embedded("smollm2:135m", gguf, details)
    assert entry.name == parse_name("smollm2:135m")
    assert entry.manifest.details == details
    assert entry.manifest.model == digest_of(gguf.read_bytes())
    assert entry.size == gguf.stat().st_size
    assert store.blob_path(entry.manifest.model).stat().st_ino == gguf.stat().st_ino
    again = store.ensure_embedded("smollm2:135m", gguf, details)
    assert again == entry  # nothing rewritten: same manifest digest and modified_at
    assert len(manifest_files(store)) == 1


def test_ensure_embedded_copies_when_links_fail(store: Store, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError("cross-device link")

    monkeypatch.setattr(store_module.os, "link", no_links)
    entry = store.ensure_embedded("smollm2:135m", gguf, {})
    blob = store.blob_path(entry.manifest.model)
    assert blob.read_bytes() == gguf.read_bytes()
    assert blob.stat().st_ino != gguf.stat().st_ino
    assert not temp_files(store.root)


def test_ensure_embedded_keeps_an_existing_model_of_that_name(store: Store, gguf: Path) -> None:
    name = model(store, "smollm2:135m", b"user weights", system="custom")
    assert store.ensure_embedded("smollm2:135m", gguf, {}).manifest.system == "custom"
    assert store.get(name).manifest.model == digest_of(b"user weights")


def test_ensure_embedded_repairs_a_missing_blob(store: Store, gguf: Path) -> None:
    entry = store.ensure_embedded("smollm2:135m", gguf, {})
    store.blob_path(entry.manifest.model).unlink()
    assert store.ensure_embedded("smollm2:135m", gguf, {}).manifest.model == entry.manifest.model
    assert store.has_blob(entry.manifest.model)


# concurrency


def test_concurrent_save_copy_delete_never_lists_a_model_with_a_missing_blob(store: Store) -> None:
    names = [parse_name(text) for text in ("a", "b", "ns/c:1", "hf.co/o/r:Q8_0")]
    payloads = [b"one", b"two", b"three"]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(50):
                name, action = rng.choice(names), rng.random()
                try:
                    if action < 0.5:
                        digest = add(store, rng.choice(payloads))
                        store.save(name, Manifest(model=digest, adapters=[add(store, rng.choice(payloads))]))
                    elif action < 0.7:
                        store.copy(name, rng.choice(names))
                    elif action < 0.95:
                        store.delete(name)
                    else:
                        store.list()
                except ModelNotFound:
                    pass
                except InvalidRequest as error:  # a concurrent delete collected a blob before save took the lock
                    assert error.code == "blob_missing"
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert not temp_files(store.root)
    for path in manifest_files(store):
        data = json.loads(path.read_text())
        for digest in [data["model"], *data["adapters"]]:
            assert store.has_blob(digest), f"{path} refers to a missing blob"
    store.gc()  # a save that lost its blob to a concurrent delete leaves its other blob behind until the next gc
    listed = store.list()
    assert len(listed) == len(manifest_files(store))
    referenced = {digest for entry in listed for digest in entry.manifest.digests}
    assert {"sha256:" + blob.name[7:] for blob in (store.root / "blobs").iterdir()} == referenced
