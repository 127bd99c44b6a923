"""The on-disk store of /v1/responses: atomic records, ids that sort by age, the count bound and the retention time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from lmserve.store.responses import ResponseNotFound, ResponseStore, StoredResponse, created_at, new_response_id

SECOND = 1_000_000_000


def record(response_id: str, text: str = "hi") -> StoredResponse:
    output = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    user = {"id": "msg_0", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
    return StoredResponse(response={"id": response_id, "object": "response", "output": output}, input=[user])


def test_ids_carry_their_creation_time_and_sort_by_it() -> None:
    early, late = new_response_id(1_700_000_000 * SECOND), new_response_id(1_700_000_001 * SECOND)
    assert early.startswith("resp_") and len(early) == 5 + 32
    assert created_at(early) == pytest.approx(1_700_000_000)
    assert sorted([late, early]) == [early, late]
    assert created_at("resp_../../etc") is None


def test_a_saved_response_reads_back_from_a_new_store(tmp_path: Path) -> None:
    response_id = new_response_id()
    ResponseStore(tmp_path).save(record(response_id, "ünïcode"))
    again = ResponseStore(tmp_path).get(response_id)  # as after a restart
    assert again == record(response_id, "ünïcode")
    assert again.conversation == [*again.input, *again.response["output"]]
    assert [p.name for p in tmp_path.iterdir()] == [f"{response_id}.json"]  # no temp file left behind


def test_the_conversation_is_context_input_then_output(tmp_path: Path) -> None:
    first = record(new_response_id(), "one")
    second = record(new_response_id(), "two")
    second.context = first.conversation
    assert second.conversation == [*first.conversation, *second.input, *second.response["output"]]


@pytest.mark.parametrize("response_id", ["resp_missing", "../secrets", "", new_response_id()],
                         ids=["missing", "path", "empty", "new"])
def test_unknown_ids_are_not_found(tmp_path: Path, response_id: str) -> None:
    store = ResponseStore(tmp_path)
    with pytest.raises(ResponseNotFound) as caught:
        store.get(response_id)
    assert caught.value.status == 404
    with pytest.raises(ResponseNotFound):
        store.delete(response_id)


def test_delete_removes_the_record(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    response_id = new_response_id()
    store.save(record(response_id))
    store.delete(response_id)
    with pytest.raises(ResponseNotFound):
        store.get(response_id)
    assert store.ids() == []


def test_the_oldest_go_beyond_the_count_bound(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path, max_count=3)
    ids = [new_response_id((1_700_000_000 + i) * SECOND) for i in range(5)]
    for response_id in reversed(ids):  # written newest first: age comes from the id, not from the write
        store.save(record(response_id))
    assert store.ids() == ids[2:]
    with pytest.raises(ResponseNotFound):
        store.get(ids[0])


def test_records_past_the_retention_time_are_gone(tmp_path: Path) -> None:
    now = [1_700_000_000.0]
    store = ResponseStore(tmp_path, ttl=60, clock=lambda: now[0])
    old, new = new_response_id(int(now[0] - 100) * SECOND), new_response_id(int(now[0]) * SECOND)
    ResponseStore(tmp_path).save(record(old))
    store.save(record(new))  # the save prunes the expired one
    assert store.ids() == [new]
    now[0] += 61
    with pytest.raises(ResponseNotFound):
        store.get(new)
    assert store.prune() == 1 and store.ids() == []


def test_a_negative_retention_keeps_records_forever(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path, ttl=-1, clock=lambda: 4e9)
    response_id = new_response_id(1 * SECOND)
    store.save(record(response_id))
    assert store.get(response_id).id == response_id


def test_a_crash_mid_write_leaves_the_old_record_and_no_partial_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResponseStore(tmp_path)
    response_id = new_response_id()
    store.save(record(response_id, "before"))

    def crash(*args: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.save(record(response_id, "after"))
    monkeypatch.undo()
    assert store.get(response_id).response["output"][0]["content"][0]["text"] == "before"
    assert [p.name for p in tmp_path.iterdir()] == [f"{response_id}.json"]


def test_stale_temp_files_are_cleared_and_unreadable_records_not_found(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    stale = tmp_path / ".tmp-leftover"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    broken = new_response_id()
    (tmp_path / f"{broken}.json").write_text("{not json")
    store.save(record(new_response_id()))
    assert not stale.exists()
    with pytest.raises(ResponseNotFound):
        store.get(broken)
    json.loads(next(p for p in tmp_path.iterdir() if p.name != f"{broken}.json").read_text())
