"""The on-disk store of chat completions (`store: true`): atomic records that survive a restart, the count bound,
the retention time, metadata updates, and listing by model and metadata, page by page, in either order."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lmserve.errors import InvalidRequest
from lmserve.store.completions import CompletionNotFound, CompletionStore, StoredCompletion, new_completion_id

SECOND = 1_000_000_000
T0 = 1_700_000_000


def record(completion_id: str, *, model: str = "m", metadata: dict[str, str] | None = None,
           text: str = "hi") -> StoredCompletion:
    completion = {"id": completion_id, "object": "chat.completion", "created": T0, "model": model,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                               "finish_reason": "stop", "logprobs": None}],
                  "metadata": metadata or {}}
    messages = [{"id": f"{completion_id}-0", "role": "user", "content": "hello", "name": None, "content_parts": None}]
    return StoredCompletion(completion=completion, messages=messages, requested_model=f"{model}-alias")


def saved(store: CompletionStore, count: int, **fields: Any) -> list[str]:
    """`count` records one second apart (oldest first), saved; their ids."""
    ids = [new_completion_id((T0 + i) * SECOND) for i in range(count)]
    for completion_id in ids:
        store.save(record(completion_id, **fields))
    return ids


def test_ids_look_like_chat_completion_ids_and_sort_by_age() -> None:
    early, late = new_completion_id(T0 * SECOND), new_completion_id((T0 + 1) * SECOND)
    assert early.startswith("chatcmpl-") and len(early) == len("chatcmpl-") + 32
    assert sorted([late, early]) == [early, late]


def test_a_saved_completion_reads_back_after_a_restart(tmp_path: Path) -> None:
    completion_id = new_completion_id()
    CompletionStore(tmp_path).save(record(completion_id, text="ünïcode"))
    assert CompletionStore(tmp_path).get(completion_id) == record(completion_id, text="ünïcode")
    assert [p.name for p in tmp_path.iterdir()] == [f"{completion_id}.json"]


@pytest.mark.parametrize("completion_id", ["chatcmpl-missing", "../secrets", "", new_completion_id()],
                         ids=["missing", "path", "empty", "new"])
def test_unknown_ids_are_not_found(tmp_path: Path, completion_id: str) -> None:
    store = CompletionStore(tmp_path)
    for action in (store.get, store.delete, lambda i: store.update_metadata(i, {})):
        with pytest.raises(CompletionNotFound) as caught:
            action(completion_id)
        assert caught.value.status == 404


def test_delete_removes_the_record(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path)
    [completion_id] = saved(store, 1)
    store.delete(completion_id)
    with pytest.raises(CompletionNotFound):
        store.get(completion_id)
    assert store.ids() == []


def test_update_replaces_the_metadata_only(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path)
    [completion_id] = saved(store, 1, metadata={"a": "1", "b": "2"})
    updated = store.update_metadata(completion_id, {"c": "3"})
    assert updated.metadata == {"c": "3"}
    again = CompletionStore(tmp_path).get(completion_id)
    assert again.metadata == {"c": "3"}
    assert again.completion["choices"] == record(completion_id).completion["choices"]


def test_the_oldest_go_beyond_the_count_bound(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path, max_count=3)
    ids = [new_completion_id((T0 + i) * SECOND) for i in range(5)]
    for completion_id in reversed(ids):  # written newest first: age comes from the id, not from the write
        store.save(record(completion_id))
    assert store.ids() == ids[2:]


def test_records_past_the_retention_time_are_gone(tmp_path: Path) -> None:
    now = [float(T0 + 100)]
    store = CompletionStore(tmp_path, ttl=60, clock=lambda: now[0])
    old, new = saved(CompletionStore(tmp_path), 1)[0], new_completion_id((T0 + 100) * SECOND)
    assert store.page().records == []  # listed only while alive
    store.save(record(new))  # the save prunes the expired one
    assert store.ids() == [new]
    with pytest.raises(CompletionNotFound):
        store.get(old)
    now[0] += 61
    with pytest.raises(CompletionNotFound):
        store.get(new)
    assert store.prune() == 1 and store.ids() == []


def test_a_crash_mid_write_leaves_the_old_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CompletionStore(tmp_path)
    [completion_id] = saved(store, 1, metadata={"v": "before"})

    def crash(*args: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.update_metadata(completion_id, {"v": "after"})
    monkeypatch.undo()
    assert store.get(completion_id).metadata == {"v": "before"}
    assert [p.name for p in tmp_path.iterdir()] == [f"{completion_id}.json"]


def test_an_unreadable_record_is_not_found_and_not_listed(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path)
    [good] = saved(store, 1)
    for text in ("{not json", "[]", '{"messages": []}', '{"completion": 3}'):
        broken = new_completion_id()
        (tmp_path / f"{broken}.json").write_text(text)
        with pytest.raises(CompletionNotFound):
            store.get(broken)
    assert [r.id for r in store.page().records] == [good]


def test_pages_go_oldest_first_by_default_and_newest_first_when_asked(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path)
    ids = saved(store, 5)
    first = store.page(limit=2)
    assert [r.id for r in first.records] == ids[:2] and first.has_more
    second = store.page(limit=2, after=ids[1])
    assert [r.id for r in second.records] == ids[2:4] and second.has_more
    last = store.page(limit=2, after=ids[3])
    assert [r.id for r in last.records] == ids[4:] and not last.has_more
    newest = store.page(limit=2, order="desc")
    assert [r.id for r in newest.records] == [ids[4], ids[3]]
    assert [r.id for r in store.page(limit=5, order="desc", after=ids[3]).records] == [ids[2], ids[1], ids[0]]


def test_after_a_record_that_has_gone_still_pages_from_where_it_stood(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path)
    ids = saved(store, 3)
    store.delete(ids[1])
    assert [r.id for r in store.page(after=ids[1]).records] == [ids[2]]
    with pytest.raises(InvalidRequest) as caught:
        store.page(after="not-an-id")
    assert caught.value.param == "after"


def test_listing_filters_by_model_and_by_every_metadata_pair(tmp_path: Path) -> None:
    store = CompletionStore(tmp_path)
    a = saved(store, 1, model="a", metadata={"user": "u1", "topic": "x"})[0]
    b = new_completion_id((T0 + 10) * SECOND)
    store.save(record(b, model="b", metadata={"user": "u1"}))
    assert [r.id for r in store.page(model="a").records] == [a]
    assert [r.id for r in store.page(model="b-alias").records] == [b]  # the name the request asked for
    assert [r.id for r in store.page(metadata={"user": "u1"}).records] == [a, b]
    assert [r.id for r in store.page(metadata={"user": "u1", "topic": "x"}).records] == [a]
    assert store.page(metadata={"user": "u2"}).records == []
    assert store.page(model="a", metadata={"topic": "y"}).records == []
