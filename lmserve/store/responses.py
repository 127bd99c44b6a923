"""Stored responses of the OpenAI Responses API (`/v1/responses`), on disk under the model store.

Layout (root: `<LMSERVE_MODELS>/responses`, made on the first save):

    resp_<16 hex: creation time in ns><16 random hex>.json      one `StoredResponse`
    .tmp-*                                                       a write in progress (renamed into place)

Records are kept by the generic record store (lmserve/store/records.py): atomic writes, ids that sort by age, a
count bound and a retention time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.errors import LmserveError
from lmserve.store.records import RecordIds, RecordStore

ID_PREFIX = "resp_"
_IDS = RecordIds(ID_PREFIX)


class ResponseNotFound(LmserveError):
    """No stored response has this id (never stored, deleted, or past the retention time)."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, response_id: str, *, param: str = "response_id") -> None:
        super().__init__(f"Response with id '{response_id[:100]}' not found.", param=param, code="response_not_found")


def new_response_id(now_ns: int | None = None) -> str:
    """A fresh response id: `resp_`, the creation time (ns, 16 hex digits), 16 random hex digits."""
    return _IDS.new(now_ns)


def created_at(response_id: str) -> float | None:
    """The Unix time (seconds) an id was made at, or None if it is not an id this store makes."""
    return _IDS.created_at(response_id)


@dataclass(slots=True)
class StoredResponse:
    """A response as the API returned it, with what it was asked.

    `input` holds the request's own input items (as `GET …/input_items` lists them, each with an id); `context`
    the items of the conversation before them (the chain of `previous_response_id`), so a later request that
    continues from this one needs no other record: its conversation is `context + input + response["output"]`.
    """

    response: dict[str, Any]
    input: list[dict[str, Any]] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the exchange so far: context, input, then the output."""
        return [*self.context, *self.input, *self.response.get("output", [])]


class ResponseStore(RecordStore[StoredResponse]):
    """Responses as JSON files under `root`, at most `max_count`, each kept `ttl` seconds (None: forever)."""

    def __init__(self, root: Path, *, max_count: int = 1000, ttl: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(root, _IDS, _decode, ResponseNotFound, max_count=max_count, ttl=ttl, clock=clock)


def _decode(data: dict[str, Any]) -> StoredResponse:
    return StoredResponse(response=data["response"], input=data.get("input", []), context=data.get("context", []))
