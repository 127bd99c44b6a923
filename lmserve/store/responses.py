"""Stored responses of the OpenAI Responses API (`/v1/responses`), on disk under the model store.

Layout (root: `<LMSERVE_MODELS>/responses`, made on the first save):

    resp_<16 hex: creation time in ns><16 random hex>.json      one `StoredResponse`
    .tmp-*                                                       a write in progress (renamed into place)

Each record is written to a temp file in the same directory, flushed, fsync'd and renamed into place, so a crash
never leaves a half-written record. An id carries its creation time, so ids sort oldest first and the bounds are
kept from a directory listing alone: after each save the oldest records beyond `max_count` go, and so do those older
than `ttl` seconds (a record past its time is also not found when asked for).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmserve.errors import LmserveError
from lmserve.store.store import TEMP_PREFIX, write_atomic

log = logging.getLogger(__name__)

ID_PREFIX = "resp_"
STALE_TEMP_SECONDS = 3600.0
_ID = re.compile(r"resp_([0-9a-f]{16})[0-9a-f]{16}\Z")


class ResponseNotFound(LmserveError):
    """No stored response has this id (never stored, deleted, or past the retention time)."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, response_id: str, *, param: str = "response_id") -> None:
        super().__init__(f"Response with id '{response_id[:100]}' not found.", param=param, code="response_not_found")


def new_response_id(now_ns: int | None = None) -> str:
    """A fresh response id: `resp_`, the creation time (ns, 16 hex digits), 16 random hex digits."""
    stamp = time.time_ns() if now_ns is None else now_ns
    return f"{ID_PREFIX}{stamp:016x}{secrets.token_hex(8)}"


def created_at(response_id: str) -> float | None:
    """The Unix time (seconds) an id was made at, or None if it is not an id this store makes."""
    match = _ID.match(response_id)
    return int(match.group(1), 16) / 1e9 if match else None


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


class ResponseStore:
    """Responses as JSON files under `root`, at most `max_count`, each kept `ttl` seconds (None: forever)."""

    def __init__(self, root: Path, *, max_count: int = 1000, ttl: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.max_count = max_count
        self.ttl = ttl if ttl is None or ttl >= 0 else None
        self._clock = clock

    def save(self, record: StoredResponse) -> None:
        """Write `record` atomically (replacing one with the same id), then drop what the bounds no longer allow."""
        path = self._path(record.id)
        if path is None:
            raise ValueError(f"not a response id this store makes: {record.id!r}")
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(record), ensure_ascii=False).encode())
        self.prune()

    def get(self, response_id: str) -> StoredResponse:
        """The stored response `response_id`; ResponseNotFound (404) when there is none (or it expired)."""
        path = self._path(response_id)
        if path is None or self._is_expired(response_id):
            raise ResponseNotFound(response_id)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise ResponseNotFound(response_id) from None
        except (OSError, ValueError) as exc:
            log.warning("stored response %s is unreadable: %s", path, exc)
            raise ResponseNotFound(response_id) from None
        return StoredResponse(response=data["response"], input=data.get("input", []), context=data.get("context", []))

    def delete(self, response_id: str) -> None:
        """Remove a stored response; ResponseNotFound (404) when there is none."""
        path = self._path(response_id)
        if path is None or self._is_expired(response_id):
            raise ResponseNotFound(response_id)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ResponseNotFound(response_id) from None

    def ids(self) -> list[str]:
        """The ids stored, oldest first (expired ones included until the next prune)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(name[:-5] for name in names if name.endswith(".json") and _ID.match(name[:-5]))

    def prune(self) -> int:
        """Remove expired records, the oldest beyond `max_count`, and stale temp files; returns how many went."""
        ids = self.ids()
        doomed = [i for i in ids if self._is_expired(i)]
        kept = [i for i in ids if not self._is_expired(i)]
        doomed += kept[: max(0, len(kept) - self.max_count)]
        for response_id in doomed:
            (self.root / f"{response_id}.json").unlink(missing_ok=True)
        self._remove_stale_temps()
        return len(doomed)

    def _path(self, response_id: str) -> Path | None:
        """Where a record lives; None for text that is no id of ours (so no name ever leaves `root`)."""
        return self.root / f"{response_id}.json" if _ID.match(response_id) else None

    def _is_expired(self, response_id: str) -> bool:
        made = created_at(response_id)
        return self.ttl is not None and made is not None and self._clock() - made > self.ttl

    def _remove_stale_temps(self) -> None:
        try:
            names = [name for name in os.listdir(self.root) if name.startswith(TEMP_PREFIX)]
        except FileNotFoundError:
            return
        for name in names:
            path = self.root / name
            try:
                if time.time() - path.stat().st_mtime > STALE_TEMP_SECONDS:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
