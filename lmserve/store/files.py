"""Files (OpenAI's `/v1/files`: batch inputs, batch outputs, …) on disk under the model store.

Layout (root: `<LMSERVE_MODELS>/files`, made on the first write):

    file-<16 hex: creation time in ns><16 random hex>.data     the file's bytes
    file-<…>.json                                              its record: name, purpose, size, times
    .tmp-*                                                     an upload in progress (renamed into place)

An upload streams into a temp file in the same directory, is flushed, fsync'd and renamed into place as `.data`;
only then is its record written (atomically, too). A record is removed before its content. So a crash never leaves
a record without its content: at worst content without a record, which is swept with stale temp files (those older
than an hour) when the store opens and after each write. Ids carry their creation time, so they sort oldest first.

Bounds, kept after each write (`prune`): a file past its `expires_at` goes (and is not found before that), then the
oldest beyond `max_count` files or `max_bytes` in all, except pinned files (an unfinished batch still reads them)
and the file just added. Records never change once written, so what a prune needs of them is cached.
"""

from __future__ import annotations

import bisect
import builtins
import errno
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from lmserve.config import env_name
from lmserve.errors import InvalidRequest, LmserveError
from lmserve.store.atomic_files import TEMP_PREFIX, write_atomic
from lmserve.store.records import STALE_TEMP_SECONDS, RecordIds

log = logging.getLogger(__name__)

FILE_ID_PREFIX = "file-"
_IDS = RecordIds(FILE_ID_PREFIX)

UploadPurpose = Literal["assistants", "batch", "fine-tune", "vision", "user_data", "evals"]
UPLOAD_PURPOSES: tuple[str, ...] = get_args(UploadPurpose)
"""The purposes an upload may name (OpenAI's list)."""
PURPOSES: tuple[str, ...] = (*UPLOAD_PURPOSES, "batch_output")
"""Every purpose a stored file may have: `batch_output` only the server makes (a batch's output and errors)."""
MAX_FILENAME = 512
"""The longest file name kept, in characters."""
CHUNK = 1 << 20
DATA, RECORD = ".data", ".json"

Order = Literal["asc", "desc"]


class FileNotFound(LmserveError):
    """No stored file has this id (never stored, deleted, or expired)."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, file_id: str) -> None:
        super().__init__(f"No such File object: {file_id[:100]}", param="file_id", code="not_found")


class FileTooLarge(LmserveError):
    """An upload is larger than the store takes."""

    status = 413
    type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The file is larger than the upload limit of {limit} bytes (set "
                         f"{env_name('files_max_upload')} to raise it).", param="file", code="file_too_large")


@dataclass(slots=True)
class StoredFile:
    """One stored file, as its record keeps it."""

    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    """Unix seconds."""
    expires_at: int | None
    """Unix seconds; None: kept until deleted (or pushed out by the bounds)."""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}


def _decode(data: Any) -> StoredFile:
    if not isinstance(data, dict):
        raise TypeError("a file record must be a JSON object")
    expires_at = data["expires_at"]
    return StoredFile(id=str(data["id"]), filename=str(data["filename"]), purpose=str(data["purpose"]),
                      bytes=int(data["bytes"]), created_at=int(data["created_at"]),
                      expires_at=None if expires_at is None else int(expires_at))


class FileStore:
    """Files under `root`: each upload at most `max_upload` bytes; at most `max_count` files and `max_bytes` in all
    (the oldest go first); each kept `ttl` seconds (None or negative: until deleted). `clock` gives Unix time in ns.
    """

    def __init__(self, root: Path, *, max_upload: int, max_count: int, max_bytes: int, ttl: float | None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.root = root
        self.max_upload = max_upload
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl = ttl if ttl is None or ttl >= 0 else None
        self._clock = clock
        self._lock = threading.Lock()
        self._pinned: set[str] = set()
        self._known: dict[str, StoredFile] = {}
        """Records read so far (they never change once written)."""
        self._last_ns = 0
        self._sweep()

    # ---- writing -------------------------------------------------------------------------------------------

    def create(self, filename: str, purpose: str, chunks: Iterable[bytes], *,
               expires_after: float | None = None) -> StoredFile:
        """Store the bytes of `chunks` as a new file (an upload: `purpose` must be one of UPLOAD_PURPOSES);
        FileTooLarge past `max_upload` bytes. `expires_after`: seconds it is kept, when sooner than the store's ttl.
        """
        _check_purpose(purpose, UPLOAD_PURPOSES)
        _check_filename(filename)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self.root, prefix=TEMP_PREFIX)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                size = 0
                for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_upload:
                        raise FileTooLarge(self.max_upload)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            return self._install(tmp, filename, purpose, size, expires_after)
        finally:
            tmp.unlink(missing_ok=True)

    def adopt(self, path: Path, filename: str, purpose: str, *, expires_after: float | None = None) -> StoredFile:
        """Move the finished file at `path` into the store as a new file (no upload limit; any of PURPOSES, such as
        `batch_output`). `path` is best on the store's filesystem (a rename); elsewhere it is copied, then removed."""
        _check_purpose(purpose, PURPOSES)
        _check_filename(filename)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TEMP_PREFIX}{os.urandom(8).hex()}"
        try:
            os.replace(path, tmp)
            is_moved = True
        except OSError as exc:  # another filesystem: copy (the original goes once the copy is in place)
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(path, tmp)
            is_moved = False
        try:
            with tmp.open("rb+") as data:
                os.fsync(data.fileno())
            os.utime(tmp)  # fresh: a sweep takes content without a record for a crash's leftover only when old
            stored = self._install(tmp, filename, purpose, tmp.stat().st_size, expires_after)
        except BaseException:
            if is_moved:  # give the file back
                os.replace(tmp, path)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        if not is_moved:
            path.unlink()
        return stored

    def delete(self, file_id: str) -> None:
        """Remove a file (its record first, then its content); FileNotFound when there is none."""
        self.get(file_id)
        with self._lock:
            try:
                self._path(file_id, RECORD).unlink()
            except FileNotFoundError:
                raise FileNotFound(file_id) from None
            finally:
                self._known.pop(file_id, None)
                self._pinned.discard(file_id)
            self._path(file_id, DATA).unlink(missing_ok=True)

    def pin(self, file_id: str) -> None:
        """Keep a file from the count and size bounds (an unfinished batch reads it) until `unpin`; expiry and
        `delete` still remove it."""
        with self._lock:
            self._pinned.add(file_id)

    def unpin(self, file_id: str) -> None:
        """Let the bounds take a pinned file again (nothing happens for a file not pinned)."""
        with self._lock:
            self._pinned.discard(file_id)

    def prune(self) -> int:
        """Remove expired files, then the oldest unpinned ones beyond `max_count` or `max_bytes`, then stale temp
        files and content without a record; returns how many files went."""
        return self._prune(keep=None)

    # ---- reading -------------------------------------------------------------------------------------------

    def get(self, file_id: str) -> StoredFile:
        """The record of file `file_id`; FileNotFound when there is none (or it expired, or no longer reads)."""
        stored = self._read(file_id) if _IDS.is_id(file_id) else None
        if stored is None or self._is_expired(stored):
            raise FileNotFound(file_id)
        return stored

    def content_path(self, file_id: str) -> Path:
        """Where the bytes of file `file_id` are (read them soon: a delete or a prune may take them);
        FileNotFound."""
        self.get(file_id)
        path = self._path(file_id, DATA)
        if not path.is_file():
            raise FileNotFound(file_id)
        return path

    def list(self, *, purpose: str | None = None, after: str | None = None, limit: int = 10000,
             order: Order = "desc") -> tuple[builtins.list[StoredFile], bool]:
        """Up to `limit` files (of `purpose`; None: any) in creation `order`, from after the file `after` (which may
        since have gone: its id still says where it stood); and whether more follow."""
        if after is not None and not _IDS.is_id(after):
            raise InvalidRequest(f"'{after[:100]}' is not the id of a file", param="after")
        ids = self._ids()
        if order == "desc":
            ordered = ids[: len(ids) if after is None else bisect.bisect_left(ids, after)][::-1]
        else:
            ordered = ids if after is None else ids[bisect.bisect_right(ids, after):]
        found: builtins.list[StoredFile] = []
        for file_id in ordered:
            stored = self._record(file_id)
            if stored is None or self._is_expired(stored):  # gone or no longer reads
                continue
            if purpose is None or stored.purpose == purpose:
                if len(found) == limit:
                    return found, True
                found.append(stored)
        return found, False

    # ---- inside --------------------------------------------------------------------------------------------

    def _install(self, tmp: Path, filename: str, purpose: str, size: int, expires_after: float | None) -> StoredFile:
        """Put the written, fsync'd `tmp` in place as a new file's content, then write its record; then prune."""
        with self._lock:
            now_ns = self._last_ns = max(self._clock(), self._last_ns + 1)  # ids made here sort by age
            file_id = _IDS.new(now_ns)
            created_at = now_ns // 1_000_000_000
            kept = min((s for s in (self.ttl, expires_after) if s is not None), default=None)
            stored = StoredFile(id=file_id, filename=filename, purpose=purpose, bytes=size, created_at=created_at,
                                expires_at=None if kept is None else created_at + int(kept))
            tmp.chmod(0o644)
            os.replace(tmp, self._path(file_id, DATA))
            try:
                write_atomic(self._path(file_id, RECORD), json.dumps(asdict(stored), ensure_ascii=False).encode())
            except BaseException:
                os.replace(self._path(file_id, DATA), tmp)  # back where the caller cleans up
                raise
            self._known[file_id] = stored
        self._prune(keep=file_id)
        return stored

    def _prune(self, keep: str | None) -> int:
        with self._lock:
            live: builtins.list[StoredFile] = []
            doomed: builtins.list[str] = []
            listed = self._ids()
            self._known = {file_id: self._known[file_id] for file_id in listed if file_id in self._known}
            for file_id in listed:
                stored = self._record(file_id)
                if stored is None or self._is_expired(stored):
                    doomed.append(file_id)
                else:
                    live.append(stored)
            count, total = len(live), sum(f.bytes for f in live)
            for stored in live:  # oldest first
                if count <= self.max_count and total <= self.max_bytes:
                    break
                if stored.id != keep and stored.id not in self._pinned:
                    doomed.append(stored.id)
                    count, total = count - 1, total - stored.bytes
            for file_id in doomed:
                self._remove(file_id)
            self._sweep()
        return len(doomed)

    def _remove(self, file_id: str) -> None:
        self._path(file_id, RECORD).unlink(missing_ok=True)
        self._path(file_id, DATA).unlink(missing_ok=True)
        self._known.pop(file_id, None)
        self._pinned.discard(file_id)

    def _record(self, file_id: str) -> StoredFile | None:
        """The record of a file just listed: cached (records never change, ids are never reused), else read."""
        return self._known.get(file_id) or self._read(file_id)

    def _read(self, file_id: str) -> StoredFile | None:
        """A record from disk (then cached); None when there is none or it no longer reads."""
        try:
            stored = _decode(json.loads(self._path(file_id, RECORD).read_bytes()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("file record %s does not read: %r", file_id, exc)
            return None
        if stored.id != file_id:
            log.warning("file record %s names another id, %s", file_id, stored.id)
            return None
        self._known[file_id] = stored
        return stored

    def _ids(self) -> builtins.list[str]:
        """The ids with a record, oldest first (expired ones included until the next prune)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        ids = sorted(name[: -len(RECORD)] for name in names if name.endswith(RECORD))
        return [file_id for file_id in ids if _IDS.is_id(file_id)]

    def _path(self, file_id: str, suffix: str) -> Path:
        return self.root / f"{file_id}{suffix}"

    def _is_expired(self, stored: StoredFile) -> bool:
        return stored.expires_at is not None and self._clock() >= stored.expires_at * 1_000_000_000

    def _sweep(self) -> None:
        """Remove temp files and content without a record left over an hour ago (by a crash)."""
        try:
            names = set(os.listdir(self.root))
        except FileNotFoundError:
            return
        for name in names:
            is_orphan = name.endswith(DATA) and name[: -len(DATA)] + RECORD not in names
            if name.startswith(TEMP_PREFIX) or is_orphan:
                path = self.root / name
                try:
                    if time.time() - path.stat().st_mtime > STALE_TEMP_SECONDS:
                        path.unlink(missing_ok=True)
                except FileNotFoundError:
                    pass


def _check_purpose(purpose: str, allowed: tuple[str, ...]) -> None:
    if purpose not in allowed:
        raise InvalidRequest(f"Invalid value for 'purpose': {purpose[:100]!r}; expected one of {', '.join(allowed)}",
                             param="purpose")


def _check_filename(filename: str) -> None:
    if not filename or len(filename) > MAX_FILENAME or "\0" in filename:
        raise InvalidRequest(f"a file name must have 1 to {MAX_FILENAME} characters and no NUL", param="file")
