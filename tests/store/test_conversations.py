"""The on-disk store of /v1/conversations: a conversation's metadata and items, changed under one lock, kept with no
retention time, bounded by count."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from lmserve.errors import InvalidRequest
from lmserve.store.conversations import ConversationNotFound, ConversationStore, ItemNotFound, new_conversation_id

YEAR = 365 * 86400.0


def message(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def test_a_conversation_reads_back_from_a_new_store(tmp_path: Path) -> None:
    made = ConversationStore(tmp_path).create([message("msg_1", "ünïcode")], {"topic": "demo"})
    assert made.id.startswith("conv_") and len(made.id) == 5 + 32
    again = ConversationStore(tmp_path).get(made.id)  # as after a restart
    assert again == made
    assert again.resource() == {"id": made.id, "object": "conversation", "created_at": made.created_at,
                                "metadata": {"topic": "demo"}}
    assert [p.name for p in tmp_path.iterdir()] == [f"{made.id}.json"]  # no temp file left behind


def test_items_are_added_read_and_deleted(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    made = store.create([message("msg_1", "one")], {})
    store.add_items(made.id, [message("msg_2", "two"), message("msg_3", "three")])
    assert [item["id"] for item in store.get(made.id).items] == ["msg_1", "msg_2", "msg_3"]
    assert store.get(made.id).item("msg_2")["content"][0]["text"] == "two"
    after = store.delete_item(made.id, "msg_2")
    assert [item["id"] for item in after.items] == ["msg_1", "msg_3"] == [i["id"] for i in store.get(made.id).items]
    with pytest.raises(ItemNotFound) as caught:
        store.delete_item(made.id, "msg_2")
    assert caught.value.status == 404 and caught.value.param == "item_id"


def test_an_item_id_is_never_stored_twice(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    with pytest.raises(InvalidRequest, match="Duplicate item found with id msg_1"):
        store.create([message("msg_1", "one"), message("msg_1", "again")], {})
    made = store.create([message("msg_1", "one")], {})
    for items in ([message("msg_1", "again")], [message("msg_2", "two"), message("msg_2", "again")]):
        with pytest.raises(InvalidRequest) as caught:
            store.add_items(made.id, items)
        assert caught.value.status == 400 and caught.value.param == "items"
    assert [item["id"] for item in store.get(made.id).items] == ["msg_1"]
    # a response's input that repeats the conversation's items: the new ones only
    store.add_items(made.id, [message("msg_1", "again"), message("msg_3", "three")], skip_known=True)
    assert [item["id"] for item in store.get(made.id).items] == ["msg_1", "msg_3"]


def test_metadata_is_replaced_whole(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    made = store.create([], {"a": "1", "b": "2"})
    assert store.update_metadata(made.id, {"c": "3"}).metadata == {"c": "3"} == store.get(made.id).metadata


@pytest.mark.parametrize("conversation_id", ["conv_missing", "../secrets", "", new_conversation_id()],
                         ids=["missing", "path", "empty", "new"])
def test_unknown_ids_are_not_found(tmp_path: Path, conversation_id: str) -> None:
    store = ConversationStore(tmp_path)
    for act in (store.get, store.delete, lambda i: store.add_items(i, []), lambda i: store.update_metadata(i, {})):
        with pytest.raises(ConversationNotFound) as caught:
            act(conversation_id)
        assert caught.value.status == 404 and caught.value.code == "conversation_not_found"


def test_a_deleted_conversation_is_gone(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    made = store.create([message("msg_1", "one")], {})
    store.delete(made.id)
    with pytest.raises(ConversationNotFound):
        store.get(made.id)
    assert list(tmp_path.iterdir()) == []


def test_items_added_at_once_from_many_threads_all_land(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    made = store.create([], {})
    threads = [threading.Thread(target=store.add_items, args=(made.id, [message(f"msg_{i}", str(i))]))
               for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(item["id"] for item in store.get(made.id).items) == sorted(f"msg_{i}" for i in range(16))


def test_no_retention_time_but_a_count_bound(tmp_path: Path) -> None:
    later = ConversationStore(tmp_path, max_count=2, clock=lambda: 1e12 + 10 * YEAR)
    first = later.create([], {})
    assert later.get(first.id) == first  # ten years on, still there
    second, third = later.create([], {}), later.create([], {})
    with pytest.raises(ConversationNotFound):
        later.get(first.id)  # the oldest went when a third came
    assert {later.get(second.id).id, later.get(third.id).id} == {second.id, third.id}


@pytest.mark.parametrize("content", [b"{not json", b"[]", json.dumps({"id": "x"}).encode(),
                                     json.dumps({"id": "x", "created_at": 1, "items": {}}).encode()])
def test_a_record_that_no_longer_reads_is_not_found(tmp_path: Path, content: bytes) -> None:
    store = ConversationStore(tmp_path)
    made = store.create([], {})
    (tmp_path / f"{made.id}.json").write_bytes(content)
    with pytest.raises(ConversationNotFound):
        store.get(made.id)
