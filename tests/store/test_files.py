"""The on-disk file store (`/v1/files`): files that survive a restart, ids that sort by age, pages in either order,
atomic writes (never a record without its content; leftovers of a crash swept), the count, size and age bounds
(pinned files and the file just added stay), and the upload limit."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmserve.config import env_name
from lmserve.errors import InvalidRequest
from lmserve.store.atomic_files import TEMP_PREFIX
from lmserve.store.files import (
    FILE_ID_PREFIX,
    PURPOSES,
    UPLOAD_PURPOSES,
    FileNotFound,
    FileStore,
    FileTooLarge,
    StoredFile,
)
from lmserve.store.records import STALE_TEMP_SECONDS

SECOND = 1_000_000_000
T0 = 1_700_000_000
DAY = 86400.0


class Clock:
    """A clock (Unix ns) that moves one second at each reading, unless set."""

    def __init__(self, start: int = T0 * SECOND) -> None:
        self.now = start

    def __call__(self) -> int:
        self.now += SECOND
        return self.now


def store_at(root: Path, *, max_upload: int = 1 << 20, max_count: int = 100, max_bytes: int = 1 << 30,
             ttl: float | None = None, clock: Clock | None = None) -> FileStore:
    return FileStore(root, max_upload=max_upload, max_count=max_count, max_bytes=max_bytes, ttl=ttl,
                     clock=clock or Clock())


def made(store: FileStore, count: int, *, purpose: str = "batch", size: int = 10) -> list[str]:
    """`count` files of `size` bytes, oldest first; their ids."""
    return [store.create(f"f{i}.jsonl", purpose, [b"x" * size]).id for i in range(count)]


def names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


# ---- create, get, content, delete ---------------------------------------------------------------------------


def test_a_created_file_reads_back_after_a_restart(tmp_path: Path) -> None:
    stored = store_at(tmp_path, ttl=30 * DAY).create("in ünïcode.jsonl", "batch", [b'{"a": 1}\n', b'{"b": 2}\n'])
    assert stored.id.startswith(FILE_ID_PREFIX) and stored.bytes == 18
    assert stored.expires_at == stored.created_at + 30 * 86400
    again = store_at(tmp_path)  # as after a restart
    assert again.get(stored.id) == stored
    assert again.content_path(stored.id).read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert names(tmp_path) == {f"{stored.id}.json", f"{stored.id}.data"}  # no temp file left behind


def test_the_openai_file_object() -> None:
    stored = StoredFile(id="file-1", filename="in.jsonl", purpose="batch", bytes=3, created_at=T0, expires_at=None)
    assert stored.to_openai() == {"id": "file-1", "object": "file", "bytes": 3, "created_at": T0, "expires_at": None,
                                  "filename": "in.jsonl", "purpose": "batch", "status": "processed",
                                  "status_details": None}


def test_ids_sort_by_age_even_within_one_clock_tick(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_upload=10, max_count=100, max_bytes=1000, ttl=None, clock=lambda: T0 * SECOND)
    ids = made(store, 5, size=1)
    assert sorted(ids) == ids and len(set(ids)) == 5


@pytest.mark.parametrize("file_id", ["file-missing", "../secrets", "", f"{FILE_ID_PREFIX}{'0' * 32}"],
                         ids=["missing", "path", "empty", "unused"])
def test_unknown_ids_are_not_found(tmp_path: Path, file_id: str) -> None:
    store = store_at(tmp_path)
    made(store, 1)
    for action in (store.get, store.content_path, store.delete):
        with pytest.raises(FileNotFound) as caught:
            action(file_id)
        err = caught.value
        assert (err.status, err.type, err.code, err.param) == (404, "invalid_request_error", "not_found", "file_id")


def test_delete_removes_the_record_and_the_content(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    gone, kept = made(store, 2)
    store.delete(gone)
    with pytest.raises(FileNotFound):
        store.get(gone)
    with pytest.raises(FileNotFound):
        store.delete(gone)
    assert names(tmp_path) == {f"{kept}.json", f"{kept}.data"}


@pytest.mark.parametrize("purpose", UPLOAD_PURPOSES)
def test_each_upload_purpose_is_taken(tmp_path: Path, purpose: str) -> None:
    assert store_at(tmp_path).create("a", purpose, [b"x"]).purpose == purpose


@pytest.mark.parametrize(("filename", "purpose", "param"), [
    ("a.jsonl", "batch_output", "purpose"),  # made by the server only
    ("a.jsonl", "fine-tune-results", "purpose"),
    ("a.jsonl", "", "purpose"),
    ("", "batch", "file"),
    ("x" * 513, "batch", "file"),
    ("a\0b", "batch", "file"),
])
def test_a_bad_upload_is_refused_and_leaves_nothing(tmp_path: Path, filename: str, purpose: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        store_at(tmp_path).create(filename, purpose, [b"x"])
    assert caught.value.param == param
    assert not tmp_path.exists() or names(tmp_path) == set()


def test_an_upload_past_the_limit_is_too_large_and_leaves_nothing(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_upload=10)
    assert store.create("ten", "batch", [b"12345", b"67890"]).bytes == 10
    with pytest.raises(FileTooLarge) as caught:
        store.create("eleven", "batch", [b"12345", b"67890", b"!"])
    err = caught.value
    assert (err.status, err.type, err.param) == (413, "invalid_request_error", "file")
    assert "10 bytes" in err.message and env_name("files_max_upload") in err.message
    assert len(names(tmp_path)) == 2 and not any(n.startswith(TEMP_PREFIX) for n in names(tmp_path))


def test_an_upload_that_fails_midway_leaves_nothing(tmp_path: Path) -> None:
    def broken() -> Iterator[bytes]:
        yield b"part"
        raise ConnectionError("client gone")

    with pytest.raises(ConnectionError):
        store_at(tmp_path).create("a", "batch", broken())
    assert names(tmp_path) == set()


# ---- adopt ------------------------------------------------------------------------------------------------------


def test_adopt_moves_a_finished_file_in_past_the_upload_limit(tmp_path: Path) -> None:
    store = store_at(tmp_path / "files", max_upload=1)
    output = tmp_path / "output.jsonl"
    output.write_bytes(b'{"id": "batch_req_1"}\n')
    stored = store.adopt(output, "batch_output.jsonl", "batch_output")
    assert not output.exists()
    assert (stored.purpose, stored.bytes, stored.filename) == ("batch_output", 22, "batch_output.jsonl")
    assert store.content_path(stored.id).read_bytes() == b'{"id": "batch_req_1"}\n'
    assert store.list(purpose="batch_output") == ([stored], False)


def test_adopt_copies_across_filesystems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_at(tmp_path / "files")
    output = tmp_path / "output.jsonl"
    output.write_bytes(b"out")
    real_replace = os.replace

    def cross_device(src: Any, dst: Any) -> None:
        if Path(src) == output:
            raise OSError(18, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", cross_device)
    stored = store.adopt(output, "out.jsonl", "batch_output")
    assert not output.exists() and store.content_path(stored.id).read_bytes() == b"out"


@pytest.mark.parametrize("cross_device", [False, True], ids=["renamed", "copied"])
def test_a_failed_adopt_leaves_the_file_where_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     cross_device: bool) -> None:
    store = store_at(tmp_path / "files")
    output = tmp_path / "output.jsonl"
    output.write_bytes(b"out")
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if cross_device and Path(src) == output:
            raise OSError(18, "Invalid cross-device link")
        real_replace(src, dst)

    def crash(path: Path, data: bytes) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr("lmserve.store.files.write_atomic", crash)
    with pytest.raises(OSError, match="power cut"):
        store.adopt(output, "out.jsonl", "batch_output")
    assert output.read_bytes() == b"out"
    assert not any(n.endswith(".json") or n.startswith(TEMP_PREFIX) for n in names(tmp_path / "files"))


def test_adopt_takes_every_purpose_but_unknown_ones(tmp_path: Path) -> None:
    store = store_at(tmp_path / "files")
    for purpose in PURPOSES:
        source = tmp_path / purpose
        source.write_bytes(b"x")
        assert store.adopt(source, "x", purpose).purpose == purpose
    source = tmp_path / "odd"
    source.write_bytes(b"x")
    with pytest.raises(InvalidRequest):
        store.adopt(source, "x", "odd")
    assert source.exists()


# ---- listing ----------------------------------------------------------------------------------------------------


def test_pages_go_newest_first_by_default_and_oldest_first_when_asked(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    ids = made(store, 5)

    def page(**kwargs: Any) -> tuple[list[str], bool]:
        found, has_more = store.list(**kwargs)
        return [f.id for f in found], has_more

    assert page() == (ids[::-1], False)
    assert page(limit=2) == ([ids[4], ids[3]], True)
    assert page(limit=2, after=ids[3]) == ([ids[2], ids[1]], True)
    assert page(limit=2, after=ids[1]) == ([ids[0]], False)
    assert page(order="asc", limit=2) == (ids[:2], True)
    assert page(order="asc", after=ids[1]) == (ids[2:], False)
    assert page(order="asc", limit=3, after=ids[1]) == (ids[2:], False)
    store.delete(ids[2])
    assert page(order="asc", after=ids[2]) == (ids[3:], False)  # a deleted cursor still says where it stood


def test_a_listing_filters_by_purpose(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    batch = made(store, 2, purpose="batch")
    user = made(store, 2, purpose="user_data")
    assert [f.id for f in store.list(purpose="user_data")[0]] == user[::-1]
    assert [f.id for f in store.list(purpose="batch", order="asc", limit=1)[0]] == batch[:1]
    assert store.list(purpose="vision") == ([], False)


def test_a_cursor_that_is_no_file_id_is_a_bad_request(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as caught:
        store_at(tmp_path).list(after="chatcmpl-123")
    assert caught.value.param == "after"


def test_an_unreadable_record_is_not_found_and_not_listed(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    [good] = made(store, 1)
    clock = Clock(T0 * SECOND * 2)
    for text in ("{not json", "[]", '{"id": 3}', json.dumps({"id": "file-other", "filename": "a", "purpose": "batch",
                                                            "bytes": 1, "created_at": 1, "expires_at": None})):
        broken = f"{FILE_ID_PREFIX}{clock():016x}{'0' * 16}"
        (tmp_path / f"{broken}.json").write_text(text)
        (tmp_path / f"{broken}.data").write_text("x")
        with pytest.raises(FileNotFound):
            store.get(broken)
    assert [f.id for f in store.list()[0]] == [good]


# ---- atomicity ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", [".data", ".json"], ids=["content-rename", "record-write"])
def test_a_write_that_fails_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    store = store_at(tmp_path)
    [kept] = made(store, 1)
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if str(dst).endswith(failing):  # the content's rename, or the record's (inside write_atomic)
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk gone"):
        store.create("a", "batch", [b"lost"])
    monkeypatch.undo()
    assert names(tmp_path) == {f"{kept}.json", f"{kept}.data"}  # no record without content, no leftovers
    assert [f.id for f in store.list()[0]] == [kept]


def test_leftovers_of_a_crash_are_swept_when_old(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    [kept] = made(store, 1)
    old_temp, new_temp = tmp_path / f"{TEMP_PREFIX}old", tmp_path / f"{TEMP_PREFIX}new"
    old_orphan, new_orphan = (tmp_path / f"{FILE_ID_PREFIX}{digit * 32}.data" for digit in "12")
    for path in (old_temp, new_temp, old_orphan, new_orphan):
        path.write_bytes(b"partial")
    for path in (old_temp, old_orphan, tmp_path / f"{kept}.data"):
        age(path, STALE_TEMP_SECONDS + 60)
    store_at(tmp_path)  # a store sweeps when it opens
    assert names(tmp_path) == {f"{kept}.json", f"{kept}.data", new_temp.name, new_orphan.name}
    for path in (new_temp, new_orphan):
        age(path, STALE_TEMP_SECONDS + 60)
    store.prune()  # and after each write
    assert names(tmp_path) == {f"{kept}.json", f"{kept}.data"}


# ---- bounds ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_count", "max_bytes", "sizes", "kept"), [
    (3, 1000, [10] * 5, [2, 3, 4]),  # the count bound
    (100, 25, [10] * 5, [3, 4]),  # the size bound
    (100, 30, [5, 30, 5], [2]),  # a large file goes with those before it
    (100, 10, [5, 30], [1]),  # the file just added stays even when it alone is over
    (2, 12, [5, 5, 5], [1, 2]),  # both
], ids=["count", "bytes", "large", "newest", "both"])
def test_the_oldest_go_beyond_the_bounds(tmp_path: Path, max_count: int, max_bytes: int, sizes: list[int],
                                         kept: list[int]) -> None:
    store = store_at(tmp_path, max_count=max_count, max_bytes=max_bytes)
    ids = [store.create("f", "batch", [b"x" * size]).id for size in sizes]
    assert [f.id for f in store.list(order="asc")[0]] == [ids[i] for i in kept]
    assert len(names(tmp_path)) == 2 * len(kept)


def test_pinned_files_survive_the_count_and_size_bounds_until_unpinned(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_count=2, max_bytes=1000)
    pinned, *_ = ids = made(store, 1)
    store.pin(pinned)
    ids += made(store, 3)
    assert [f.id for f in store.list(order="asc")[0]] == [pinned, ids[-1]]
    store.unpin(pinned)
    assert store.prune() == 0  # within the bounds again
    ids += made(store, 1)
    assert [f.id for f in store.list(order="asc")[0]] == ids[-2:]


def test_files_past_their_time_are_not_found_then_pruned(tmp_path: Path) -> None:
    clock = Clock()
    store = store_at(tmp_path, ttl=60, clock=clock)
    [old] = made(store, 1)
    store.pin(old)  # pins hold off the bounds, not expiry
    clock.now += 61 * SECOND
    for action in (store.get, store.content_path):
        with pytest.raises(FileNotFound):
            action(old)
    assert store.list() == ([], False)
    [new] = made(store, 1)  # the write prunes the expired one
    assert names(tmp_path) == {f"{new}.json", f"{new}.data"}


@pytest.mark.parametrize(("ttl", "expires_after", "kept"), [
    (None, None, None),
    (-1.0, None, None),  # negative: until deleted
    (60.0, None, 60),
    (None, 3600.0, 3600),
    (60.0, 3600.0, 60),  # the sooner of the two
    (7200.0, 3600.0, 3600),
])
def test_a_file_expires_after_the_sooner_of_the_ttl_and_its_own(tmp_path: Path, ttl: float | None,
                                                                  expires_after: float | None,
                                                                  kept: int | None) -> None:
    stored = store_at(tmp_path, ttl=ttl).create("a", "batch", [b"x"], expires_after=expires_after)
    assert stored.expires_at == (None if kept is None else stored.created_at + kept)
