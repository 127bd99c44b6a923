"""Conversations of the OpenAI Conversations API (`/v1/conversations`), on disk under the model store.

Layout (root: `<LMSERVE_MODELS>/conversations`, made on the first save):

    conv_<16 hex: creation time in ns><16 random hex>.json      one `StoredConversation`
    .tmp-*                                                       a write in progress (renamed into place)

Records are kept by the generic record store (lmserve/store/records.py): atomic writes, ids that sort by age, a
count bound. As at OpenAI, a conversation has no retention time: it stays until it is deleted (or until the count
bound drops it, the oldest first). A change (items added or deleted, metadata replaced) reads, changes and writes
the record under one lock, so two responses that end at once in the same conversation both land in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.errors import InvalidRequest, LmserveError
from lmserve.store.records import RecordIds, RecordStore

ID_PREFIX = "conv_"
_IDS = RecordIds(ID_PREFIX)

Item = dict[str, Any]


class ConversationNotFound(LmserveError):
    """No conversation has this id (never made, or deleted)."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, conversation_id: str, *, param: str = "conversation_id") -> None:
        super().__init__(f"Conversation with id '{conversation_id[:100]}' not found.", param=param,
                         code="conversation_not_found")


class ItemNotFound(LmserveError):
    """The conversation has no item with this id."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, item_id: str) -> None:
        super().__init__(f"Item with id '{item_id[:100]}' not found.", param="item_id", code="item_not_found")


def new_conversation_id(now_ns: int | None = None) -> str:
    """A fresh conversation id: `conv_`, the creation time (ns, 16 hex digits), 16 random hex digits."""
    return _IDS.new(now_ns)


@dataclass(slots=True)
class StoredConversation:
    """A conversation: its id, creation time (Unix seconds) and metadata, and its items in order (each with an id,
    in the shapes a response's input and output items have)."""

    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[Item] = field(default_factory=list)

    def resource(self) -> dict[str, Any]:
        """The conversation as the API returns it (`ConversationResource`)."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def item(self, item_id: str) -> Item:
        """The item `item_id`; ItemNotFound when there is none."""
        for item in self.items:
            if item.get("id") == item_id:
                return item
        raise ItemNotFound(item_id)


class ConversationStore(RecordStore[StoredConversation]):
    """Conversations as JSON files under `root`, at most `max_count`."""

    def __init__(self, root: Path, *, max_count: int = 1000, clock: Callable[[], float] = time.time) -> None:
        super().__init__(root, _IDS, _decode, ConversationNotFound, max_count=max_count, ttl=None, clock=clock)
        self._lock = threading.Lock()

    def create(self, items: list[Item], metadata: dict[str, str]) -> StoredConversation:
        """A new conversation with these first `items` and `metadata`, saved (InvalidRequest when two items have
        one id)."""
        _check_new_ids([], items)
        record = StoredConversation(new_conversation_id(), int(self._clock()), dict(metadata), list(items))
        self.save(record)
        return record

    def add_items(self, conversation_id: str, items: list[Item], *, skip_known: bool = False) -> StoredConversation:
        """Append `items` to a conversation; the conversation as it is now. An item whose id the conversation (or
        another of `items`) already has is an InvalidRequest, or, with `skip_known`, left out (a response's input
        that repeats items of the conversation)."""

        def append(record: StoredConversation) -> None:
            known = {item.get("id") for item in record.items} - {None}
            if skip_known:
                record.items.extend(item for item in items if item.get("id") is None or item.get("id") not in known)
                return
            _check_new_ids(record.items, items)
            record.items.extend(items)

        return self._change(conversation_id, append)

    def delete_item(self, conversation_id: str, item_id: str) -> StoredConversation:
        """Remove one item (ItemNotFound when the conversation has none with this id); the conversation now."""

        def remove(record: StoredConversation) -> None:
            record.items.remove(record.item(item_id))

        return self._change(conversation_id, remove)

    def update_metadata(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation:
        """Replace a conversation's metadata; the conversation as it is now."""

        def replace(record: StoredConversation) -> None:
            record.metadata = dict(metadata)

        return self._change(conversation_id, replace)

    def delete(self, record_id: str) -> None:
        """Remove a conversation and its items; ConversationNotFound when there is none."""
        with self._lock:
            super().delete(record_id)

    def _change(self, conversation_id: str, change: Callable[[StoredConversation], None]) -> StoredConversation:
        with self._lock:
            record = self.get(conversation_id)
            change(record)
            self.save(record)
            return record


def _check_new_ids(existing: list[Item], items: list[Item]) -> None:
    """InvalidRequest when an item of `items` has the id of an item before it (in `existing` or `items`): paging
    and item routes find items by id."""
    seen = {item.get("id") for item in existing} - {None}
    for item in items:
        item_id = item.get("id")
        if item_id is None:
            continue
        if item_id in seen:
            raise InvalidRequest(f"Duplicate item found with id {item_id}.", param="items")
        seen.add(item_id)


def _decode(data: dict[str, Any]) -> StoredConversation:
    conversation_id, metadata, items = data["id"], data.get("metadata", {}), data.get("items", [])
    if not isinstance(conversation_id, str) or not _IDS.is_id(conversation_id):
        raise ValueError("a stored conversation's id must be a conversation id")
    if not isinstance(metadata, dict) or not isinstance(items, list):
        raise TypeError("a stored conversation's metadata must be an object and its items a list")
    return StoredConversation(conversation_id, int(data["created_at"]), metadata, items)
