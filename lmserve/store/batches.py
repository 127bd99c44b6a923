"""Batches (OpenAI's Batch API, `/v1/batches`) on disk under the model store, so that a batch outlives the server.

Layout (root: `<LMSERVE_MODELS>/batches`, made on the first save):

    batch_<16 hex: creation time in ns><16 random hex>.json     one `BatchRecord`, rewritten atomically
    runs/<batch id>.output.jsonl                                results of the lines that succeeded (HTTP 200)
    runs/<batch id>.errors.jsonl                                lines refused when checked, and lines that failed

The records are kept by the generic record store (lmserve/store/records.py). A run's results are appended one line
at a time, each written whole and fsync'd before the next (`ResultLog`): after a crash the logs hold every line that
finished, and a half-written last line (the crash came mid-write) is cut off when the log is opened again, so its
request runs again and is written once. The `custom_id`s in the two logs are the lines that are done: a batch that
resumes runs the others. When a batch ends its logs become files (the files store adopts them).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmserve.errors import LmserveError
from lmserve.store.records import RecordIds, RecordStore

BATCH_ID_PREFIX = "batch_"
_IDS = RecordIds(BATCH_ID_PREFIX)

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]
ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
"""The statuses of a batch that has not ended: a server that starts resumes these."""


class BatchNotFound(LmserveError):
    """No batch has this id (never made, or past the retention time)."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, batch_id: str) -> None:
        super().__init__(f"No batch found with id '{batch_id[:100]}'.", param="batch_id", code="not_found")


def new_batch_id(now_ns: int | None = None) -> str:
    return _IDS.new(now_ns)


@dataclass(slots=True)
class BatchRecord:
    """A batch as `GET /v1/batches/{id}` returns it (`to_openai`), plus what the server needs to resume it."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: Status = "validating"
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    """Why the batch failed as a whole (its input is no JSONL): OpenAI's `errors.data` items."""
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    """Tokens of the lines that succeeded: input_tokens, output_tokens, total_tokens."""
    model: str | None = None
    """The model of the first line that names one (OpenAI reports the batch's model)."""
    output_expires_after: int | None = None
    """Seconds the output and error files are kept after they are made (None: the files store's retention)."""

    def to_openai(self) -> dict[str, Any]:
        usage = {"input_tokens": self.usage.get("input_tokens", 0),
                 "output_tokens": self.usage.get("output_tokens", 0),
                 "total_tokens": self.usage.get("total_tokens", 0),
                 "input_tokens_details": {"cached_tokens": self.usage.get("cached_tokens", 0)},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": usage, "metadata": self.metadata,
        }

    @classmethod
    def decode(cls, data: dict[str, Any]) -> BatchRecord:
        return cls(**data)


class ResultLog:
    """An append-only JSONL file of result lines, each written whole and fsync'd; `done` is the custom ids in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        self.num_lines = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+b")  # noqa: SIM115 - kept open for the batch's run, closed by close()
        self._recover()

    def _recover(self) -> None:
        """Read what is there; cut a last line that was not written whole (no newline, or no JSON)."""
        self._file.seek(0)
        data = self._file.read()
        end = 0
        for raw in data.splitlines(keepends=True):
            try:
                line = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                line = None
            if not isinstance(line, dict):
                break
            end += len(raw)
            self.num_lines += 1
            if isinstance(line.get("custom_id"), str):
                self.done.add(line["custom_id"])
        if end < len(data):
            self._file.truncate(end)
            self._sync()
        self._file.seek(0, os.SEEK_END)

    def append(self, line: dict[str, Any]) -> None:
        """Write one result line and make it durable before returning."""
        self._file.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
        self._sync()
        self.num_lines += 1
        if isinstance(line.get("custom_id"), str):
            self.done.add(line["custom_id"])

    def lines(self) -> Iterator[dict[str, Any]]:
        """The lines written so far."""
        self._file.flush()
        with open(self.path, "rb") as log:
            for raw in log:
                yield json.loads(raw)

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class BatchClaim:
    """A held batch lock (`BatchStore.claim`); `release` lets it go."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1


class BatchStore:
    """Batch records and their result logs under `root`; at most `max_count` records, each kept `ttl` seconds."""

    def __init__(self, root: Path, *, max_count: int = 10000, ttl: float | None = 30 * 86400.0) -> None:
        self.root = root
        self.records: RecordStore[BatchRecord] = RecordStore(root, _IDS, BatchRecord.decode, BatchNotFound,
                                                             max_count=max_count, ttl=ttl)

    def new(self, endpoint: str, input_file_id: str, completion_window: str, window_seconds: float,
            metadata: dict[str, str] | None) -> BatchRecord:
        """A new batch, saved, in status `validating`."""
        now_ns = time.time_ns()
        created = now_ns // 10**9
        record = BatchRecord(id=new_batch_id(now_ns), endpoint=endpoint, input_file_id=input_file_id,
                             completion_window=completion_window, created_at=created,
                             expires_at=created + int(window_seconds), metadata=metadata)
        self.save(record)
        return record

    def save(self, record: BatchRecord) -> None:
        self.records.save(record)
        self._remove_orphan_logs()

    def get(self, batch_id: str) -> BatchRecord:
        return self.records.get(batch_id)

    def all(self) -> list[BatchRecord]:
        """Every batch that still reads, oldest first."""
        found = []
        for batch_id in self.records.live_ids():
            try:
                found.append(self.records.get(batch_id))
            except BatchNotFound:
                continue
        return found

    def log_path(self, batch_id: str, kind: Literal["output", "errors"]) -> Path:
        return self.root / "runs" / f"{batch_id}.{kind}.jsonl"

    def open_log(self, batch_id: str, kind: Literal["output", "errors"]) -> ResultLog:
        return ResultLog(self.log_path(batch_id, kind))

    def claim(self, batch_id: str) -> BatchClaim | None:
        """Hold the right to run a batch (an exclusive lock on `runs/<id>.lock`, which the system lets go when the
        process ends, however it ends); None when another process holds it (servers sharing a store)."""
        path = self.root / "runs" / f"{batch_id}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return BatchClaim(fd)

    def _remove_orphan_logs(self) -> None:
        """Logs whose batch the bounds removed go too."""
        runs = self.root / "runs"
        try:
            names = os.listdir(runs)
        except FileNotFoundError:
            return
        live = set(self.records.ids())
        for name in names:
            if name.split(".", 1)[0] not in live and not name.endswith(".lock"):
                (runs / name).unlink(missing_ok=True)
