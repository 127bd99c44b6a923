"""The disk tier of the prompt cache: saved prompt states that outlive a slot, a model load and a restart.

An entry is one file, `root/<digest of model key>/<digest of model key + tokens>.state`, so a lookup never scans:

    lmserve-prompt-state 1\\n                                        magic and format version
    {"digest": …, "model_key": …, "num_tokens": …, "state_bytes": …}\\n   header (JSON, one line)
    tokens                                                             int32 little-endian
    state                                                              opaque bytes (a llama.cpp sequence state)

The digest is a CRC-32 of tokens + state (it catches corruption, at 5x blake2b's speed: a 22 MiB state is checked in
about 6 ms where the cache is read; the file name and header bind the model key and tokens). A file is handed out
only after its magic, version, header, model key, tokens, length and digest check out; anything else is deleted
and forgotten with one warning, so a corrupt, truncated or foreign file never reaches llama.cpp.

Writes go through a queue to a writer thread of the tier's own, so `put` never waits on the disk: a temporary file
in the same folder, then `os.replace`. There is no fsync: this is a cache, and a file torn by a power loss fails its
digest and is dropped. Before each write the least recently used files (across all model keys; the files' mtime is
the clock, refreshed on a hit) are deleted until the new one fits the budget. The root's total size is read at start,
files of earlier instances included; a model key's token index is read from its files' headers when first asked for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import sys
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeAlias

log = logging.getLogger(__name__)

MAGIC = b"lmserve-prompt-state"
VERSION = 1
SavedState: TypeAlias = bytes | bytearray | mmap.mmap
"""A sequence state as the engine saved it: any buffer of bytes, never written to once saved."""
WRITER_NICENESS = 19
"""The writer thread's niceness (Linux sets it per thread): the lowest, short of starving it."""


def _yield_to_decoding() -> None:
    """Give the calling thread the lowest niceness: llama.cpp's threads meet at a barrier after each operation, so a
    core taken from one of them for a write stalls the whole step (measured: 10 conversations on 4 slots, 2 cores,
    returning turns 8% slower with the writer at normal priority). Not the idle class: on a machine kept busy by
    others the writes would never run, and an unprivileged thread cannot raise its priority again to finish them
    at shutdown (`close` writes what is left on its caller's thread)."""
    with suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)

SUFFIX = ".state"
TEMP_SUFFIX = ".tmp"
MAX_HEADER_BYTES = 64 * 1024
MAX_PENDING_ENTRIES = 64
MAX_PENDING_BYTES = 1 << 30  # queued writes are held in memory: at most a quarter of the budget, and at most this
STALE_TEMP_S = 600.0  # a temporary file this old is a leftover even if its writer's process id is alive


class _Corrupt(Exception):
    """A file that is not a valid entry for what was asked."""


@dataclass(slots=True)
class _File:
    """An entry file on disk: its size, and what it holds once a header was read (None before)."""

    size: int
    model_key: str | None = None
    tokens: tuple[int, ...] | None = None


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("i", tokens)
    if packed.itemsize != 4:
        raise OverflowError("C int is not 32 bits on this platform")
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _tokens_from(data: bytes) -> tuple[int, ...]:
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return tuple(packed)


def _folder_name(model_key: str) -> str:
    return hashlib.blake2b(model_key.encode(), digest_size=16).hexdigest()


def _file_name(model_key: str, token_bytes: bytes) -> str:
    digest = hashlib.blake2b(model_key.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(token_bytes)
    return digest.hexdigest() + SUFFIX


def _content_digest(token_bytes: bytes, state: SavedState) -> str:
    return f"crc32:{zlib.crc32(state, zlib.crc32(token_bytes)):08x}"


def _encode_head(model_key: str, token_bytes: bytes, state: SavedState) -> bytes:
    header = {
        "model_key": model_key,
        "num_tokens": len(token_bytes) // 4,
        "state_bytes": len(state),
        "digest": _content_digest(token_bytes, state),
    }
    return b"%s %d\n%s\n" % (MAGIC, VERSION, json.dumps(header, sort_keys=True).encode())


def _read_header(f: BinaryIO) -> tuple[dict[str, object], int]:
    """The header of an open entry file and the file offset after it; _Corrupt when it is not ours or not this
    version."""
    magic, _, version = f.readline(len(MAGIC) + 16).rstrip(b"\n").partition(b" ")
    if magic != MAGIC:
        raise _Corrupt("not a prompt state file")
    if version != b"%d" % VERSION:
        raise _Corrupt(f"format version {version.decode(errors='replace')}, expected {VERSION}")
    line = f.readline(MAX_HEADER_BYTES)
    try:
        header = json.loads(line) if line.endswith(b"\n") else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise _Corrupt("unreadable header")
    for name, kind in (("model_key", str), ("num_tokens", int), ("state_bytes", int), ("digest", str)):
        if not isinstance(header.get(name), kind):
            raise _Corrupt(f"header without {name}")
    return header, f.tell()


def _read_entry(path: Path, model_key: str, with_state: bool) -> tuple[tuple[int, ...], bytes | None]:
    """The tokens (and, if asked, the verified state) of the entry at `path` for `model_key`.

    Raises _Corrupt for anything that is not exactly such an entry; OSError (FileNotFoundError…) passes through."""
    with open(path, "rb") as f:
        header, offset = _read_header(f)
        if header["model_key"] != model_key:
            raise _Corrupt("the file belongs to another model key")
        num_tokens, state_bytes = header["num_tokens"], header["state_bytes"]
        assert isinstance(num_tokens, int) and isinstance(state_bytes, int)
        if num_tokens < 0 or state_bytes < 0 or os.fstat(f.fileno()).st_size != offset + 4 * num_tokens + state_bytes:
            raise _Corrupt("truncated, or its length does not match its header")
        token_bytes = f.read(4 * num_tokens)
        if _file_name(model_key, token_bytes) != path.name:
            raise _Corrupt("the file holds other tokens than its name says")
        if not with_state:
            return _tokens_from(token_bytes), None
        state = f.read(state_bytes)
    if len(token_bytes) + len(state) != 4 * num_tokens + state_bytes:
        raise _Corrupt("truncated while reading")
    if _content_digest(token_bytes, state) != header["digest"]:
        raise _Corrupt("its digest does not match its content")
    return _tokens_from(token_bytes), state


def _pid_alive(pid: int) -> bool:
    if os.name != "posix" or pid == os.getpid():
        return True  # elsewhere, only the age of a temporary file says it is a leftover
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, another user's
    return True


def _is_stale_temp(entry: os.DirEntry[str], now: float) -> bool:
    """A temporary file `.<name>.<pid>.<random>.tmp` whose writer is gone, or which is too old to be in progress."""
    parts = entry.name.split(".")
    try:
        pid = int(parts[-3])
        age = now - entry.stat().st_mtime
    except (IndexError, ValueError, OSError):
        return True
    return age > STALE_TEMP_S or not _pid_alive(pid)


class DiskTier:
    """Saved prompt states on disk under `root`, one folder per model key, least recently used first within
    `budget_bytes`; writes happen on a writer thread of its own (never blocking the caller)."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = Path(root)
        self.budget_bytes = max(0, budget_bytes)
        self.num_dropped = 0
        self._cond = threading.Condition()
        self._files: OrderedDict[str, _File] = OrderedDict()  # "folder/name" → file, least recently used first
        self._bytes = 0
        self._tokens: dict[str, set[tuple[int, ...]]] = {}  # model key → token tuples known to be on disk
        self._indexed: set[str] = set()  # model keys whose folder's headers were read
        self._pending: OrderedDict[tuple[str, tuple[int, ...]], SavedState] = OrderedDict()  # until written
        self._pending_bytes = 0
        self._max_pending_bytes = min(self.budget_bytes // 4, MAX_PENDING_BYTES)
        self._closing = False
        self._doomed: list[str] = []  # files to unlink (removed entries), on the writer thread
        self._writer: threading.Thread | None = None
        if not self.budget_bytes:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self._index_root()
        self._unlink(self._make_room(0))
        self._writer = threading.Thread(target=self._run, name="lmserve-prompt-disk", daemon=True)
        self._writer.start()

    @property
    def num_bytes(self) -> int:
        """Bytes on disk of this tier (all model keys), kept <= budget_bytes."""
        with self._cond:
            return self._bytes

    @property
    def num_entries(self) -> int:
        """Entry files on disk (all model keys); queued writes are not counted until written."""
        with self._cond:
            return len(self._files)

    def put(self, model_key: str, tokens: tuple[int, ...], state: SavedState) -> None:
        """Queue a write (returns at once). Skips when the same (model_key, tokens) is already on disk or queued,
        or state is larger than the budget. If the queue already holds more than ~budget/4 bytes (or 64 entries)
        of pending writes, drop this one (count it in `num_dropped`) instead of growing memory."""
        if not self.budget_bytes or not tokens or len(state) + 4 * len(tokens) > self.budget_bytes:
            return
        key = (model_key, tokens)
        with self._cond:
            if self._closing or key in self._pending or tokens in self._tokens.get(model_key, ()):
                return
            over_bytes = self._pending_bytes + len(state) > self._max_pending_bytes
            if len(self._pending) >= MAX_PENDING_ENTRIES or (self._pending and over_bytes):
                self.num_dropped += 1
                return
            self._pending[key] = state
            self._pending_bytes += len(state)
            self._cond.notify_all()

    def keys(self, model_key: str) -> list[tuple[int, ...]]:
        """The token tuples saved for this model (index read from the files' headers the first time a model key is
        asked for, then kept up to date by put/evict); includes entries still queued."""
        if not self.budget_bytes:
            return []
        with self._cond:
            indexed = model_key in self._indexed
        if not indexed:
            self._index_model(model_key)
        with self._cond:
            found = list(self._tokens.get(model_key, ()))
            known = set(found)
            found += [tokens for queued_key, tokens in self._pending if queued_key == model_key and tokens not in known]
        return found

    def load(self, model_key: str, tokens: tuple[int, ...]) -> SavedState | None:
        """The state saved for exactly these tokens, verified; None when absent, or when the file is corrupt,
        truncated, of another model key, of other tokens, or of another format version (such a file is deleted
        and forgotten, with one log warning). A hit touches the entry (LRU). A queued, not yet written entry is
        returned from memory."""
        if not self.budget_bytes or not tokens:
            return None
        with self._cond:
            queued = self._pending.get((model_key, tokens))
            if queued is not None:
                return queued
            if model_key in self._indexed and tokens not in self._tokens.get(model_key, ()):
                return None
        rel = f"{_folder_name(model_key)}/{_file_name(model_key, _token_bytes(tokens))}"
        path = self.root / rel
        try:
            _, state = _read_entry(path, model_key, with_state=True)
        except _Corrupt as e:
            self._discard(rel, str(e))
            return None
        except FileNotFoundError:
            self._forget([rel])
            return None
        except OSError as e:
            log.warning("prompt cache: cannot read %s: %s", path, e)
            return None
        self._touch(rel, model_key, tokens)
        return state

    def remove(self, model_key: str, tokens: tuple[int, ...]) -> None:
        """Forget an entry, queued or on disk (another entry now serves what it did)."""
        if not self.budget_bytes or not tokens:
            return
        rel = f"{_folder_name(model_key)}/{_file_name(model_key, _token_bytes(tokens))}"
        with self._cond:
            queued = self._pending.pop((model_key, tokens), None)
            if queued is not None:
                self._pending_bytes -= len(queued)
            if rel in self._files:
                self._doomed.append(rel)  # unlinked by the writer: freeing a large file's pages takes milliseconds
                self._cond.notify_all()
            self._drop_from_index(rel)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (or timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the writer thread after the write it is doing, and write what is still queued on this thread, at
        its priority (writes still queued after the timeout are dropped)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            with self._cond:
                item = next(iter(self._pending.items()), None)
            if item is None:
                break
            (model_key, tokens), state = item
            try:
                self._write_entry(model_key, tokens, state)
            except Exception:
                log.exception("prompt cache: could not save a prompt state to %s", self.root)
            with self._cond:
                self._pending.pop((model_key, tokens), None)
        with self._cond:
            self._pending.clear()
            self._pending_bytes = 0

    # -- index ---------------------------------------------------------------------------------------------------

    def _index_root(self) -> None:
        """Every entry file under the root (sizes, mtime order); stale temporary files are removed."""
        now = time.time()
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.root) as folders:
            for folder in folders:
                if folder.is_dir(follow_symlinks=False):
                    found += self._index_folder(folder, now)
        for _, rel, size in sorted(found):
            self._files[rel] = _File(size)
            self._bytes += size

    @staticmethod
    def _index_folder(folder: os.DirEntry[str], now: float) -> list[tuple[float, str, int]]:
        """(mtime, "folder/name", size) of a folder's entry files; its stale temporary files are removed."""
        found: list[tuple[float, str, int]] = []
        with os.scandir(folder.path) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX):
                    with suppress(OSError):
                        stat = entry.stat()
                        found.append((stat.st_mtime, f"{folder.name}/{entry.name}", stat.st_size))
                elif entry.name.endswith(TEMP_SUFFIX) and _is_stale_temp(entry, now):
                    with suppress(OSError):
                        os.unlink(entry.path)
        return found

    def _index_model(self, model_key: str) -> None:
        """Read the headers of a model key's files (outside the lock), then record their tokens."""
        folder = _folder_name(model_key)
        try:
            with os.scandir(self.root / folder) as entries:
                names = [e.name for e in entries if e.name.endswith(SUFFIX)]
        except OSError:
            names = []
        found: dict[str, tuple[int, ...]] = {}
        for name in names:
            rel = f"{folder}/{name}"
            try:
                found[rel] = _read_entry(self.root / rel, model_key, with_state=False)[0]
            except _Corrupt as e:
                self._discard(rel, str(e))
            except FileNotFoundError:
                self._forget([rel])
            except OSError as e:
                log.warning("prompt cache: cannot read %s: %s", self.root / rel, e)
        with self._cond:
            tokens = self._tokens.setdefault(model_key, set())
            for rel, entry_tokens in found.items():
                file = self._files.get(rel)
                if file is not None:  # else evicted meanwhile, or written by another process since our start
                    file.model_key, file.tokens = model_key, entry_tokens
                    tokens.add(entry_tokens)
            self._indexed.add(model_key)

    def _touch(self, rel: str, model_key: str, tokens: tuple[int, ...]) -> None:
        """A hit: refresh the file's mtime and make it the most recently used."""
        try:
            os.utime(self.root / rel)
            size = os.stat(self.root / rel).st_size
        except OSError:
            return  # evicted while being read
        with self._cond:
            file = self._files.get(rel)
            if file is None:  # written by another process since our start: count it from now on
                file = self._files[rel] = _File(size)
                self._bytes += size
            self._files.move_to_end(rel)
            file.model_key, file.tokens = model_key, tokens
            self._tokens.setdefault(model_key, set()).add(tokens)

    def _discard(self, rel: str, reason: str) -> None:
        log.warning("prompt cache: removing %s: %s", self.root / rel, reason)
        self._unlink([rel])
        self._forget([rel])

    def _forget(self, rels: Sequence[str]) -> None:
        with self._cond:
            for rel in rels:
                self._drop_from_index(rel)

    def _drop_from_index(self, rel: str) -> None:
        file = self._files.pop(rel, None)
        if file is None:
            return
        self._bytes -= file.size
        if file.model_key is not None and file.tokens is not None:
            self._tokens.get(file.model_key, set()).discard(file.tokens)

    def _make_room(self, size: int) -> list[str]:
        """Forget the least recently used files until `size` more bytes fit; returns them, to be unlinked."""
        victims: list[str] = []
        with self._cond:
            while self._files and self._bytes + size > self.budget_bytes:
                rel = next(iter(self._files))
                self._drop_from_index(rel)
                victims.append(rel)
            self._bytes += size
        return victims

    def _unlink(self, rels: Sequence[str]) -> None:
        for rel in rels:
            with suppress(OSError):
                os.unlink(self.root / rel)

    # -- writer --------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        _yield_to_decoding()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending or self._doomed) or self._closing)
                doomed, self._doomed = self._doomed, []
                item = None if self._closing else next(iter(self._pending.items()), None)
            self._unlink(doomed)  # before any write: a removed entry written again later is kept
            if item is None:
                if self._closing:
                    return
                continue
            key, state = item
            try:
                self._write_entry(key[0], key[1], state)
            except Exception:
                log.exception("prompt cache: could not save a prompt state to %s", self.root)
            with self._cond:
                if self._pending.get(key) is state:
                    del self._pending[key]
                    self._pending_bytes -= len(state)
                elif key not in self._pending:  # removed while it was written: the file goes too
                    rel = f"{_folder_name(key[0])}/{_file_name(key[0], _token_bytes(key[1]))}"
                    self._drop_from_index(rel)
                    self._doomed.append(rel)
                self._cond.notify_all()

    def _write_entry(self, model_key: str, tokens: tuple[int, ...], state: SavedState) -> None:
        """Write one entry (this thread only): make room, write it atomically, then index it."""
        token_bytes = _token_bytes(tokens)
        rel = f"{_folder_name(model_key)}/{_file_name(model_key, token_bytes)}"
        head = _encode_head(model_key, token_bytes, state)
        size = len(head) + len(token_bytes) + len(state)
        with self._cond:
            if rel in self._files or size > self.budget_bytes:
                return
        self._unlink(self._make_room(size))
        try:
            self._write_file(self.root / rel, (head, token_bytes, state))
        except BaseException:
            with self._cond:
                self._bytes -= size
            raise
        with self._cond:
            self._drop_from_index(rel)  # the same entry, found on a hit meanwhile (another process wrote it)
            self._files[rel] = _File(size, model_key, tokens)
            self._tokens.setdefault(model_key, set()).add(tokens)

    def _write_file(self, path: Path, chunks: Sequence[SavedState]) -> None:
        """Write `chunks` to `path` atomically: a temporary file in the same folder, then os.replace (no fsync)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            with open(temp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            os.replace(temp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp)
            raise
