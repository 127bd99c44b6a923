"""The runner of OpenAI's Batch API (its routes: lmserve/endpoints/batches.py): batches over the files store, run by
the server itself, durable across restarts.

    POST /v1/batches                     create: input_file_id (purpose "batch"), endpoint, completion_window,
                                         metadata, output_expires_after
    GET  /v1/batches                     list, newest first: after, limit (1 to 100, default 20)
    GET  /v1/batches/{id}                one
    POST /v1/batches/{id}/cancel         stop it: lines in flight are dropped, what finished is kept

A batch's life: `validating` (its input is read and checked line by line: a bad line goes to the error file with
its custom_id and the reason; an input with no JSON line at all fails the batch) → `in_progress` (its lines run
through the app's own routes, in process, at the lowest priority, so interactive requests go first) →
`finalizing` (its result logs become files: output_file_id, error_file_id) → `completed`; or `cancelling` →
`cancelled`, `expired` (the completion window passed: the lines not run go to the error file), `failed`.

Durability: the record and the result logs are on disk (store/batches.py), a line's result is written, fsync'd,
before it counts. A server that starts resumes every batch that had not ended, running only the lines whose
custom_id no log holds, so no line is lost or written twice (a request cut off by the crash runs again).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from lmserve.config import ServerConfig
from lmserve.errors import InvalidRequest, LmserveError
from lmserve.service.batch_lines import BatchLine, CheckedInput, Send, check_lines, error_line, run_lines
from lmserve.store.batches import ACTIVE, BatchRecord, BatchStore, ResultLog
from lmserve.store.files import FileNotFound, FileStore

log = logging.getLogger(__name__)

_WINDOW = re.compile(r"([1-9]\d{0,3})h")
MAX_METADATA = 16
SAVE_EVERY = 2.0
"""Seconds between saves of a running batch's counts (a resumed batch counts its logs again anyway)."""


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int


class BatchCreate(BaseModel):
    """The body of POST /v1/batches."""

    model_config = ConfigDict(extra="allow")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


class BatchNotCancellable(LmserveError):
    status = 409
    type = "invalid_request_error"

    def __init__(self, batch_id: str, status: str) -> None:
        super().__init__(f"Batch '{batch_id}' is {status}; only a validating or in-progress batch can be cancelled.",
                         code="batch_not_cancellable")


def batch_store(config: ServerConfig) -> BatchStore:
    """The batches under the model store: `<LMSERVE_MODELS>/batches` (made on the first save)."""
    return BatchStore(Path(config.models_dir).expanduser() / "batches", ttl=config.files_ttl)


def window_seconds(window: str) -> int:
    """A completion window (`24h`; whole hours, 1 to 9999) in seconds; a 400 otherwise."""
    match = _WINDOW.fullmatch(window)
    if match is None:
        raise InvalidRequest(f"completion_window must be a number of hours such as '24h', not '{window[:20]}'",
                             param="completion_window")
    return int(match.group(1)) * 3600


def _now() -> int:
    return int(time.time())


class _Run:
    """A batch being run: its record (what GET returns while it runs), its logs and its stop signal."""

    def __init__(self, record: BatchRecord) -> None:
        self.record = record
        self.stop = asyncio.Event()
        self.expired = False
        self.task: asyncio.Task[None] | None = None


class BatchService:
    """Creates, lists, cancels and runs batches; `start` resumes those a stopped server left unfinished."""

    def __init__(self, store: BatchStore, files: FileStore, *, endpoints: Sequence[str], concurrency: int) -> None:
        """`endpoints`: the routes a batch may name (every dialect's batch endpoints, lmserve/dialects/table.py)."""
        self._endpoints = tuple(endpoints)
        self.store = store
        self.files = files
        self.concurrency = concurrency
        self._send: Send | None = None
        self._runs: dict[str, _Run] = {}

    async def start(self, send: Send, *, resume: bool = True) -> None:
        """Run lines through `send` from now on, and (`resume`) every batch that had not ended."""
        self._send = send
        for record in await asyncio.to_thread(self.store.all) if resume else []:
            if record.status in ACTIVE:
                log.info("resuming batch %s (%s)", record.id, record.status)
                self._launch(record)

    async def stop(self) -> None:
        """Stop running (the server stops): the batches stay as they are on disk, to resume at the next start; the
        lines in flight are cancelled, unwritten. Stopping again does nothing."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runs.clear()

    async def create(self, body: BatchCreate) -> BatchRecord:
        if body.endpoint not in self._endpoints:
            raise InvalidRequest(f"endpoint must be one of {', '.join(self._endpoints)}", param="endpoint")
        seconds = window_seconds(body.completion_window)
        _check_metadata(body.metadata)
        if body.output_expires_after is not None and not 3600 <= body.output_expires_after.seconds <= 30 * 86400:
            raise InvalidRequest("output_expires_after.seconds must be between 3600 and 2592000",
                                 param="output_expires_after")
        try:
            stored = await asyncio.to_thread(self.files.get, body.input_file_id)
        except FileNotFound:
            raise InvalidRequest(f"No file found with id '{body.input_file_id[:100]}'.", param="input_file_id",
                                 code="not_found") from None
        if stored.purpose != "batch":
            raise InvalidRequest(f"the input file's purpose is '{stored.purpose}'; a batch reads a file uploaded with "
                                 "purpose 'batch'", param="input_file_id")
        record = await asyncio.to_thread(self.store.new, body.endpoint, body.input_file_id, body.completion_window,
                                         seconds, body.metadata)
        if body.output_expires_after is not None:
            record.output_expires_after = body.output_expires_after.seconds
            await asyncio.to_thread(self.store.save, record)
        self._launch(record)
        return record

    async def get(self, batch_id: str) -> BatchRecord:
        run = self._runs.get(batch_id)
        return run.record if run is not None else await asyncio.to_thread(self.store.get, batch_id)

    async def page(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Up to `limit` batches after the one `after`, newest first, and whether more follow."""
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100", param="limit")
        records = (await asyncio.to_thread(self.store.all))[::-1]
        if after is not None:
            ids = [record.id for record in records]
            if after not in ids:
                raise InvalidRequest(f"no batch has the id '{after[:100]}'", param="after")
            records = records[ids.index(after) + 1:]
        shown = [self._runs[r.id].record if r.id in self._runs else r for r in records[:limit]]
        return shown, len(records) > limit

    async def cancel(self, batch_id: str) -> BatchRecord:
        run = self._runs.get(batch_id)
        if run is None:
            record = await asyncio.to_thread(self.store.get, batch_id)
            raise BatchNotCancellable(batch_id, record.status)
        record = run.record
        if record.status not in ("validating", "in_progress"):
            if record.status == "cancelling":
                return record
            raise BatchNotCancellable(batch_id, record.status)
        record.status, record.cancelling_at = "cancelling", _now()
        await asyncio.to_thread(self.store.save, record)
        run.stop.set()
        return record

    # ---- running -------------------------------------------------------------------------------------------------

    def _launch(self, record: BatchRecord) -> None:
        run = _Run(record)
        self._runs[record.id] = run
        run.task = asyncio.create_task(self._run(run), name=f"lmserve-{record.id}")

    async def _run(self, run: _Run) -> None:
        record = run.record
        claim = await asyncio.to_thread(self.store.claim, record.id)
        if claim is None:  # another server on this store runs it
            self._runs.pop(record.id, None)
            return
        self.files.pin(record.input_file_id)
        try:
            await self._work(run)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("batch %s failed", record.id)
            record.status, record.failed_at = "failed", _now()
            record.errors = [{"code": "server_error", "message": f"the batch could not run: {exc}", "line": None,
                              "param": None}]
            await asyncio.to_thread(self.store.save, record)
        finally:
            claim.release()
            self.files.unpin(record.input_file_id)
            if record.status not in ACTIVE:
                self._runs.pop(record.id, None)

    async def _work(self, run: _Run) -> None:
        record = run.record
        lines = await self._read_input(run)
        if lines is None:
            return
        output = await asyncio.to_thread(self.store.open_log, record.id, "output")
        errors = await asyncio.to_thread(self.store.open_log, record.id, "errors")
        try:
            _recount(record, output, errors)
            if record.status == "in_progress":
                done = output.done | errors.done
                await self._run_lines(run, [line for line in lines if line.custom_id not in done], output, errors)
            if run.expired:
                for line in lines:
                    if line.custom_id not in output.done | errors.done:
                        errors.append(error_line(line.custom_id, "batch_expired", "the batch's completion window "
                                                 "passed before this request ran"))
                        record.failed += 1
        finally:
            output.close()
            errors.close()
        await self._finish(run)

    async def _read_input(self, run: _Run) -> list[BatchLine] | None:
        """The lines to run; while validating, the refused lines are written to a fresh error log first and the
        batch moves on to in_progress (or fails: no JSONL). None when the batch has ended."""
        record = run.record
        try:
            path = await asyncio.to_thread(self.files.content_path, record.input_file_id)
            checked = await asyncio.to_thread(_check_file, path, record.endpoint)
        except FileNotFound:
            checked = None
        if checked is None or (record.status == "validating" and (not checked.is_jsonl or checked.fatal)):
            code, why = (("file_not_found", "the input file was deleted before the batch ran") if checked is None else
                         ("duplicate_custom_id", checked.fatal) if checked.fatal else
                         ("invalid_json_line", "the input file has no JSONL request lines (one JSON object per line)"))
            record.status, record.failed_at = "failed", _now()
            record.errors = [{"code": code, "message": why, "line": None, "param": "input_file_id"}]
            await asyncio.to_thread(self.store.save, record)
            return None
        if record.status == "validating":
            def write_refused() -> None:
                self.store.log_path(record.id, "errors").unlink(missing_ok=True)
                errors = self.store.open_log(record.id, "errors")
                for refused in checked.refused:
                    errors.append(refused)
                errors.close()

            await asyncio.to_thread(write_refused)
            record.total = len(checked.lines) + len(checked.refused)
            record.model = checked.model
            record.status, record.in_progress_at = "in_progress", _now()
            if run.stop.is_set():  # cancelled while validating
                record.status = "cancelling"
            await asyncio.to_thread(self.store.save, record)
        return checked.lines

    async def _run_lines(self, run: _Run, lines: list[BatchLine], output: ResultLog, errors: ResultLog) -> None:
        assert self._send is not None
        record = run.record

        saved = [time.monotonic()]

        def on_result(line: BatchLine, result: dict[str, Any]) -> None:
            if result["response"]["status_code"] == 200:
                output.append(result)
                record.completed += 1
                _add_usage(record, result)
            else:
                errors.append(result)
                record.failed += 1
            if time.monotonic() - saved[0] > SAVE_EVERY:  # for GETs that read the disk (another server's batch)
                self.store.save(record)
                saved[0] = time.monotonic()

        left = record.expires_at - time.time()
        expiry = asyncio.get_running_loop().call_later(max(left, 0), _expire, run)
        try:
            await run_lines(lines, self._send, on_result, concurrency=self.concurrency, stop=run.stop)
        finally:
            expiry.cancel()

    async def _finish(self, run: _Run) -> None:
        """Turn the logs into files and end the batch (finalizing, then completed / cancelled / expired)."""
        record = run.record
        ending: Literal["completed", "cancelled", "expired"] = (
            "cancelled" if record.status == "cancelling" else "expired" if run.expired else "completed")
        if ending == "completed" and record.status != "finalizing":
            record.status, record.finalizing_at = "finalizing", _now()
            await asyncio.to_thread(self.store.save, record)
        expires_after = record.output_expires_after
        record.output_file_id = record.output_file_id or await asyncio.to_thread(
            self._adopt, record, "output", expires_after)
        record.error_file_id = record.error_file_id or await asyncio.to_thread(
            self._adopt, record, "errors", expires_after)
        now = _now()
        record.status = ending
        if ending == "completed":
            record.completed_at = now
        elif ending == "cancelled":
            record.cancelled_at = now
        else:
            record.expired_at = now
        await asyncio.to_thread(self.store.save, record)

    def _adopt(self, record: BatchRecord, kind: Literal["output", "errors"], expires_after: int | None) -> str | None:
        """The file of a batch's log: adopted now, or found (a server that stopped right after adopting it)."""
        name = f"{record.id}_{'output' if kind == 'output' else 'error'}.jsonl"
        path = self.store.log_path(record.id, kind)
        if path.exists():
            if path.stat().st_size == 0:
                path.unlink()
                return None
            return self.files.adopt(path, name, "batch_output", expires_after=expires_after).id
        page, _ = self.files.list(purpose="batch_output")
        return next((stored.id for stored in page if stored.filename == name), None)


def _expire(run: _Run) -> None:
    """The completion window passed: stop sending lines (those not run go to the error file)."""
    if run.record.status == "in_progress":
        run.expired = True
        run.stop.set()


def _check_file(path: Path, endpoint: str) -> CheckedInput:
    with open(path, "rb") as source:
        return check_lines(source, (endpoint,))


def _recount(record: BatchRecord, output: ResultLog, errors: ResultLog) -> None:
    """The counts and usage of a batch from its logs (a resumed batch's in memory were lost)."""
    record.completed, record.failed = output.num_lines, errors.num_lines
    record.usage = {}
    for line in output.lines():
        _add_usage(record, line)


def _add_usage(record: BatchRecord, result: dict[str, Any]) -> None:
    usage = (result.get("response") or {}).get("body", {}) or {}
    usage = usage.get("usage") if isinstance(usage, dict) else None
    if not isinstance(usage, dict):
        return
    prompt = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0)
    completion = int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0
    for key, value in (("input_tokens", prompt), ("output_tokens", completion),
                       ("total_tokens", prompt + completion), ("cached_tokens", cached)):
        record.usage[key] = record.usage.get(key, 0) + value


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise InvalidRequest(f"metadata has at most {MAX_METADATA} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise InvalidRequest("metadata keys are at most 64 characters and values 512", param="metadata")
