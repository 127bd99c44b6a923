"""A bounded on-disk store of JSON records whose ids carry their creation time (stored responses, stored chat
completions).

Layout (`root`, made on the first write):

    <prefix><16 hex: creation time in ns><16 random hex>.json      one record
    .tmp-*                                                         a write in progress (renamed into place)

Each record is written to a temp file in the same directory, flushed, fsync'd and renamed into place, so a crash
never leaves a half-written record. An id carries its creation time, so ids sort oldest first and the bounds are
kept from a directory listing alone: after each write the oldest records beyond `max_count` go, and so do those
older than `ttl` seconds (a record past its time is also not found when asked for).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import Field, asdict
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from lmserve.errors import LmserveError
from lmserve.store.atomic_files import TEMP_PREFIX, write_atomic

log = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 3600.0


class RecordIds:
    """The ids of one kind of record: `prefix`, the creation time (ns, 16 hex digits), 16 random hex digits."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._pattern = re.compile(re.escape(prefix) + r"([0-9a-f]{16})[0-9a-f]{16}\Z")

    def new(self, now_ns: int | None = None) -> str:
        """A fresh id, made now (or at `now_ns`)."""
        stamp = time.time_ns() if now_ns is None else now_ns
        return f"{self.prefix}{stamp:016x}{secrets.token_hex(8)}"

    def created_at(self, record_id: str) -> float | None:
        """The Unix time (seconds) an id was made at, or None if it is not an id of this kind."""
        match = self._pattern.match(record_id)
        return int(match.group(1), 16) / 1e9 if match else None

    def is_id(self, record_id: str) -> bool:
        return self._pattern.match(record_id) is not None


class Record(Protocol):
    """A record kept by a RecordStore: a dataclass with an id."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def id(self) -> str: ...


R = TypeVar("R", bound=Record)


class RecordStore(Generic[R]):
    """Records (dataclasses, as JSON) under `root`, at most `max_count`, each kept `ttl` seconds (None or negative:
    forever).

    `decode(data)` makes a record of its JSON object again (a KeyError or TypeError: it no longer reads);
    `missing(record_id)` is the error (a 404) raised for an id that has no record.
    """

    def __init__(self, root: Path, ids: RecordIds, decode: Callable[[dict[str, Any]], R],
                 missing: Callable[[str], LmserveError], *, max_count: int = 1000, ttl: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.record_ids = ids
        self.decode = decode
        self.missing = missing
        self.max_count = max_count
        self.ttl = ttl if ttl is None or ttl >= 0 else None
        self._clock = clock

    def save(self, record: R) -> None:
        """Write `record` atomically (replacing one with the same id), then drop what the bounds no longer allow."""
        self.write(record.id, asdict(record))

    def get(self, record_id: str) -> R:
        """Record `record_id`; the `missing` error when there is none (or it expired, or no longer reads)."""
        data = self.read(record_id)
        try:
            return self.decode(data)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("stored record %s does not read: %r", record_id, exc)
            raise self.missing(record_id) from None

    def write(self, record_id: str, data: dict[str, Any]) -> None:
        """Write `data` atomically as record `record_id` (replacing it), then drop what the bounds no longer allow."""
        path = self._path(record_id)
        if path is None:
            raise ValueError(f"not an id this store makes: {record_id!r}")
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, ensure_ascii=False).encode())
        self.prune()

    def read(self, record_id: str) -> dict[str, Any]:
        """Record `record_id`; the `missing` error when there is none (or it expired, or no longer reads)."""
        path = self._path(record_id)
        if path is None or self._is_expired(record_id):
            raise self.missing(record_id)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise self.missing(record_id) from None
        except (OSError, ValueError) as exc:
            log.warning("stored record %s is unreadable: %s", path, exc)
            raise self.missing(record_id) from None
        if not isinstance(data, dict):
            log.warning("stored record %s is not a JSON object", path)
            raise self.missing(record_id)
        return data

    def delete(self, record_id: str) -> None:
        """Remove a record; the `missing` error when there is none."""
        path = self._path(record_id)
        if path is None or self._is_expired(record_id):
            raise self.missing(record_id)
        try:
            path.unlink()
        except FileNotFoundError:
            raise self.missing(record_id) from None

    def ids(self) -> list[str]:
        """The ids stored, oldest first (expired ones included until the next prune)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(name[:-5] for name in names if name.endswith(".json") and self.record_ids.is_id(name[:-5]))

    def live_ids(self) -> list[str]:
        """The ids stored and not expired, oldest first."""
        return [i for i in self.ids() if not self._is_expired(i)]

    def prune(self) -> int:
        """Remove expired records, the oldest beyond `max_count`, and stale temp files; returns how many went."""
        ids = self.ids()
        doomed = [i for i in ids if self._is_expired(i)]
        kept = [i for i in ids if not self._is_expired(i)]
        doomed += kept[: max(0, len(kept) - self.max_count)]
        for record_id in doomed:
            (self.root / f"{record_id}.json").unlink(missing_ok=True)
        self._remove_stale_temps()
        return len(doomed)

    def _path(self, record_id: str) -> Path | None:
        """Where a record lives; None for text that is no id of ours (so no name ever leaves `root`)."""
        return self.root / f"{record_id}.json" if self.record_ids.is_id(record_id) else None

    def _is_expired(self, record_id: str) -> bool:
        made = self.record_ids.created_at(record_id)
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
