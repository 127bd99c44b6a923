"""Stored chat completions (`store: true` on `/v1/chat/completions`), on disk under the model store.

Layout (root: `<LMSERVE_MODELS>/chat-completions`, made on the first save):

    chatcmpl-<16 hex: creation time in ns><16 random hex>.json      one `StoredCompletion`
    .tmp-*                                                          a write in progress (renamed into place)

Records are kept by the generic record store (lmserve/store/records.py): atomic writes, ids that sort by age, a
count bound and a retention time. Listing reads records newest or oldest first and stops once a page is full.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmserve.errors import InvalidRequest, LmserveError
from lmserve.store.records import RecordIds, RecordStore

ID_PREFIX = "chatcmpl-"
_IDS = RecordIds(ID_PREFIX)

Order = Literal["asc", "desc"]


class CompletionNotFound(LmserveError):
    """No stored chat completion has this id (never stored, deleted, or past the retention time)."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, completion_id: str) -> None:
        super().__init__(f"No chat completion found with id '{completion_id[:100]}'.", param="completion_id",
                         code="not_found")


def new_completion_id(now_ns: int | None = None) -> str:
    """A fresh id for a stored chat completion: `chatcmpl-`, the creation time (ns, 16 hex digits), 16 random hex
    digits (as long as the ids of completions not stored)."""
    return _IDS.new(now_ns)


@dataclass(slots=True)
class StoredCompletion:
    """A chat completion as `GET /v1/chat/completions/{id}` returns it (its `metadata` included), the request's
    messages as `GET …/{id}/messages` lists them (each with an id), and the model name the request asked for."""

    completion: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    requested_model: str = ""

    @property
    def id(self) -> str:
        return str(self.completion["id"])

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.completion.get("metadata") or {})

    def matches(self, model: str | None, metadata: dict[str, str]) -> bool:
        """Made by `model` (its served or its requested name; None: any), with every pair of `metadata`."""
        if model is not None and model not in (self.completion.get("model"), self.requested_model):
            return False
        own = self.metadata
        return all(own.get(key) == value for key, value in metadata.items())


def _decode(data: dict[str, Any]) -> StoredCompletion:
    completion = data["completion"]
    if not isinstance(completion, dict):
        raise TypeError("a stored completion must be a JSON object")
    return StoredCompletion(completion=completion, messages=list(data.get("messages") or []),
                            requested_model=str(data.get("requested_model") or ""))


@dataclass(slots=True)
class CompletionPage:
    """One page of a listing, and whether more match beyond it."""

    records: list[StoredCompletion]
    has_more: bool


class CompletionStore(RecordStore[StoredCompletion]):
    """Chat completions as JSON files under `root`, at most `max_count`, each kept `ttl` seconds (None: forever)."""

    def __init__(self, root: Path, *, max_count: int = 1000, ttl: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(root, _IDS, _decode, CompletionNotFound, max_count=max_count, ttl=ttl, clock=clock)

    def update_metadata(self, completion_id: str, metadata: dict[str, str]) -> StoredCompletion:
        """Replace the metadata of a stored completion; the record as it is now."""
        record = self.get(completion_id)
        record.completion["metadata"] = dict(metadata)
        self.save(record)
        return record

    def page(self, *, model: str | None = None, metadata: dict[str, str] | None = None, after: str | None = None,
             limit: int = 20, order: Order = "asc") -> CompletionPage:
        """Up to `limit` stored completions by `model` with all of `metadata`, in creation `order`, from after the
        completion `after` (which may since have gone: its id still says where it stood)."""
        if after is not None and not _IDS.is_id(after):
            raise InvalidRequest(f"'{after[:100]}' is not the id of a stored chat completion", param="after")
        found: list[StoredCompletion] = []
        for record in self._records(order, after):
            if record.matches(model, metadata or {}):
                if len(found) == limit:
                    return CompletionPage(found, has_more=True)
                found.append(record)
        return CompletionPage(found, has_more=False)

    def _records(self, order: Order, after: str | None) -> Iterator[StoredCompletion]:
        """The live records in `order`, those up to and including `after` skipped; records that vanish or no longer
        read while listing are passed over."""
        ids = self.live_ids()
        if order == "desc":
            start = len(ids) if after is None else bisect.bisect_left(ids, after)
            ordered = ids[:start][::-1]
        else:
            ordered = ids if after is None else ids[bisect.bisect_right(ids, after):]
        for completion_id in ordered:
            try:
                yield self.get(completion_id)
            except CompletionNotFound:
                continue
