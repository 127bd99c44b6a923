"""Model store: content-addressed blobs plus one JSON manifest per `name:tag`, under one root directory.

Layout (root from `LMSERVE_MODELS`, default `~/.lmserve/models`):

    blobs/sha256-<hex>                                         GGUF weights, projectors, adapters, repository files
    manifests/<host or "local">/<namespace or "library">/<name>/<tag>      one JSON `Manifest`
    repos/<16 hex digits>/                                     a repository's (or PEFT adapter's) files as symlinks
    .lock                                                      flock'd around save, delete, gc and repos/ changes

Every write goes to a `.tmp-*` file in the target directory and is renamed into place, so a crash or a
concurrent `rm` never leaves a half-written blob or model listed. Blobs are written first, without the lock;
a manifest is written under the lock after checking that its blobs exist. Delete+gc, get, list and copy hold the
same lock, so gc never removes a blob a model being saved refers to, and a reader never sees a manifest whose
blobs went meanwhile. Blobs no manifest mentions are removed when the last model using them goes.

A Hugging Face repository (config.json + safetensors + tokenizer files) is stored file by file as blobs; its
manifest's `files` maps each relative path to a digest. `model_path` lays it out as a directory of relative
symlinks under `repos/` (named by a hash of that map, so models with the same files share it), made in a temp
directory and renamed into place on first use; gc removes the directories no manifest refers to.
Known limit (as in the local runner): a blob uploaded for a model that is not yet saved can be collected by a
concurrent delete; `save` then fails with 400 code `blob_missing` and the blob must be uploaded again.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from lmserve.errors import InvalidRequest, LmserveError, ModelNotFound
from lmserve.store.atomic_files import TEMP_PREFIX, remove_if_stale, write_atomic
from lmserve.store.embedded import removed_hint
from lmserve.store.manifest import SCHEMA_VERSION, Manifest, ModelEntry, check_digest, decode_manifest
from lmserve.store.names import ModelName, parse_name
from lmserve.store.repository import check_relative_path
from lmserve.store.repository_links import add_repository, has_links, make_links, remove_tree, repository_key

logger = logging.getLogger(__name__)
ENV_VAR = "LMSERVE_MODELS"
DEFAULT_ROOT = "~/.lmserve/models"
_DIGEST_IN_TEXT = re.compile(r"sha256:([0-9a-f]{64})")
_BLOB_NAME = re.compile(r"sha256-[0-9a-f]{64}")
_LOCAL_HOST = "local"
_DEFAULT_NAMESPACE = "library"
_CHUNK = 1 << 20


class Store:
    """Manifests and content-addressed blobs under `root`; safe across threads and processes (Linux/macOS)."""

    def __init__(self, root: Path) -> None:
        """Open (and create if needed) a store at `root`, with its `blobs/` and `manifests/` directories."""
        self.root = root
        self._blobs = root / "blobs"
        self._manifests = root / "manifests"
        self._repos = root / "repos"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._manifests.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Store:
        """The store at `$LMSERVE_MODELS`, or `~/.lmserve/models` when unset or empty."""
        env = os.environ if env is None else env
        return cls(Path(env.get(ENV_VAR) or DEFAULT_ROOT).expanduser())

    # blobs

    def blob_path(self, digest: str) -> Path:
        """Where the blob with this (validated) digest lives; the path never leaves `blobs/`."""
        return self._blobs / ("sha256-" + check_digest(digest).removeprefix("sha256:"))

    def has_blob(self, digest: str) -> bool:
        """True when the blob is stored (the digest is validated first)."""
        return self.blob_path(digest).is_file()

    def add_blob(self, source: BinaryIO | Path, expected: str | None = None) -> str:
        """Copy `source` into the store while hashing it and return its digest.

        With `expected`, bytes hashing to anything else raise InvalidRequest (code `digest_mismatch`) and leave no
        file behind. The blob appears atomically (temp file, fsync, rename).
        """
        if expected is not None:
            check_digest(expected)
        fd, tmp_name = tempfile.mkstemp(dir=self._blobs, prefix=TEMP_PREFIX)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                if isinstance(source, Path):
                    with source.open("rb") as src:
                        digest = _hash(src, out)
                else:
                    digest = _hash(source, out)
                out.flush()
                os.fsync(out.fileno())
            if expected is not None and digest != expected:
                message = f"digest mismatch: the bytes hash to {digest}, not {expected}"
                raise InvalidRequest(message, param="digest", code="digest_mismatch")
            tmp.chmod(0o644)
            self._install(tmp, digest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest

    def import_file(self, path: Path) -> str:
        """Add a local file and return its digest: hard-linked into `blobs/` when possible, else copied.

        A hard link shares the file's bytes, so the source must not be edited in place afterwards (the embedded
        GGUF and downloaded files are not).
        """
        if not path.is_file():
            raise InvalidRequest(f"{path} is not a file", param="from")
        path = path.resolve()  # link the file a symlink points to (a hub cache snapshot), not the symlink
        tmp = self._blobs / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            os.link(path, tmp)
        except OSError:  # another filesystem, no permission, no hard links: copy
            return self.add_blob(path)
        try:
            with tmp.open("rb") as linked:
                digest = _hash(linked, None)
            self._install(tmp, digest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest

    def model_path(self, manifest: Manifest) -> Path:
        """What the engine opens: the GGUF blob, or for a repository its directory under `repos/` (symlinks to the
        blobs), laid out on first use and checked (and repaired) on each call."""
        if not manifest.files:
            return self.blob_path(manifest.model)
        return self.folder_path(manifest.files)

    def adapter_paths(self, manifest: Manifest) -> list[Path]:
        """Where a model's LoRA adapters lie: GGUF blobs, then PEFT directories (laid out as `folder_path`)."""
        return [*map(self.blob_path, manifest.adapters), *map(self.folder_path, manifest.adapter_dirs)]

    def folder_path(self, files: dict[str, str]) -> Path:
        """The directory under `repos/` of symlinks to the blobs of `files` (relative path → digest), laid out on first
        use and checked (and repaired) on each call."""
        directory = self._repos / repository_key(files)
        links = {name: self._link_target(directory, name, digest) for name, digest in files.items()}
        with self._lock():
            if not has_links(directory, links):
                if os.path.lexists(directory):
                    remove_tree(directory)
                self._repos.mkdir(exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=self._repos, prefix=TEMP_PREFIX))
                try:
                    make_links(tmp, links)
                    os.rename(tmp, directory)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
        return directory

    def _link_target(self, directory: Path, name: str, digest: str) -> str:
        """The relative symlink target from `directory/name` to the blob of `digest`."""
        link = directory / check_relative_path(name)
        return os.path.relpath(self.blob_path(digest), link.parent)

    def _install(self, tmp: Path, digest: str) -> None:
        final = self.blob_path(digest)
        if final.exists():
            tmp.unlink()
        else:
            os.replace(tmp, final)

    # manifests

    def save(self, name: ModelName, manifest: Manifest) -> None:
        """Write `manifest` as model `name` (replacing any), setting its `modified_at` to now.

        Its blobs must already be stored: a missing one raises InvalidRequest (code `blob_missing`).
        """
        path = self._manifest_path(name)
        for digest in manifest.digests:
            check_digest(digest)
        with self._lock():
            self._write_locked(name, path, manifest)

    def _write_locked(self, name: ModelName, path: Path, manifest: Manifest) -> None:
        for digest in manifest.digests:
            if not self.has_blob(digest):
                raise InvalidRequest(
                    f"blob {digest} is missing; upload it before creating '{name}'", param="digest", code="blob_missing"
                )
        manifest.modified_at = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"schema_version": SCHEMA_VERSION, **asdict(manifest)}, indent=1).encode())

    def get(self, name: ModelName) -> ModelEntry:
        """The stored model `name`; ModelNotFound (404) if absent, LmserveError (500) if its files are broken."""
        path = self._manifest_path(name)
        with self._lock():  # a consistent view: no gc between reading the manifest and its blobs
            return self._load(name, path)

    def stamp(self, name: ModelName) -> tuple[int, int, int] | None:
        """What changes whenever model `name`'s manifest is written or removed (its file's inode, size and
        modification time: each save renames a new file into place), read without the lock; None when it has none."""
        try:
            info = os.stat(self._manifest_path(name))
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_size, info.st_mtime_ns

    def find(self, text: str) -> ModelEntry:
        """Parse `text` as a model name (tag defaults to `latest`) and return that model.

        ModelNotFound names the model as `text` wrote it, lists some that exist, and says how to bring back the
        embedded model when that is the one missing.
        """
        try:
            return self.get(parse_name(text))
        except ModelNotFound:
            available = [str(entry.name) for entry in self.list()]
            raise ModelNotFound(text, available=available, hint=removed_hint(text)) from None

    def list(self) -> list[ModelEntry]:
        """Every readable model, newest first; corrupt manifests and models with missing blobs are logged, skipped."""
        entries: list[ModelEntry] = []
        with self._lock():
            for path in self._manifest_files():
                name = self._name_of(path)
                if name is None:
                    continue
                try:
                    entries.append(self._load(name, path))
                except LmserveError as error:
                    logger.warning("skipping model %s: %s", name, error.message)
        entries.sort(key=lambda entry: entry.manifest.modified_at, reverse=True)
        return entries

    def copy(self, source: ModelName, destination: ModelName) -> None:
        """Save a copy of model `source` as `destination` (blobs are shared, not copied)."""
        source_path, destination_path = self._manifest_path(source), self._manifest_path(destination)
        with self._lock():
            manifest = copy.deepcopy(self._load(source, source_path).manifest)
            self._write_locked(destination, destination_path, manifest)

    def delete(self, name: ModelName) -> None:
        """Remove model `name` (ModelNotFound if absent), then the blobs no other model refers to."""
        path = self._manifest_path(name)
        with self._lock():
            try:
                path.unlink()
            except FileNotFoundError:
                raise ModelNotFound(str(name)) from None
            parent = path.parent
            while parent != self._manifests:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent
            self._gc_locked()

    def gc(self) -> int:
        """Remove blobs no manifest refers to and temp files older than an hour; return how many went."""
        with self._lock():
            return self._gc_locked()

    def ensure_embedded(self, name: str, path: Path, details: dict[str, Any]) -> ModelEntry:
        """Register the GGUF at `path` as model `name` unless a readable model of that name exists; no network.

        Idempotent: a later call returns the stored entry untouched (a model removed with `rm` comes back). The
        blob is hard-linked when `path` is on the same filesystem, so registering costs one hashing pass.
        """
        model_name = parse_name(name)
        try:
            return self.get(model_name)
        except ModelNotFound:
            pass
        except LmserveError as error:  # corrupt manifest or missing blob: register afresh
            logger.warning("re-registering %s: %s", model_name, error.message)
        for attempt in range(3):  # a concurrent delete may collect the blob between import and save
            digest = self.import_file(path)
            try:
                self.save(model_name, Manifest(model=digest, details=dict(details)))
                break
            except InvalidRequest as error:
                if error.code != "blob_missing" or attempt == 2:
                    raise
        return self.get(model_name)

    # internals

    def _manifest_path(self, name: ModelName) -> Path:
        if parse_name(str(name)) != name:  # parse_name raises on '..', '/', odd characters …
            raise InvalidRequest(f"invalid model name {str(name)!r}: not in canonical form", param="model")
        namespace = name.namespace or _DEFAULT_NAMESPACE
        return self._manifests / (name.host or _LOCAL_HOST) / namespace / name.name / name.tag

    def _name_of(self, path: Path) -> ModelName | None:
        """The model name a manifest path stands for, or None for temp files and anything else."""
        host, namespace, model, tag = path.relative_to(self._manifests).parts
        parts = [model] if host == _LOCAL_HOST and namespace == _DEFAULT_NAMESPACE else [namespace, model]
        if host != _LOCAL_HOST:
            parts.insert(0, host)
        try:
            name = parse_name("/".join(parts) + ":" + tag)
        except InvalidRequest:
            return None
        return name if self._manifest_path(name) == path else None

    def _manifest_files(self) -> builtins.list[Path]:
        """Files four levels under manifests/ (host/namespace/name/tag), temp files included, sorted."""
        level = [self._manifests]
        for _ in range(4):
            entries: list[Path] = []
            for directory in level:
                with contextlib.suppress(OSError):  # not a directory, or removed by a concurrent delete
                    entries += sorted(directory.iterdir())
            level = entries
        return [path for path in level if path.is_file()]

    def _load(self, name: ModelName, path: Path) -> ModelEntry:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ModelNotFound(str(name)) from None
        except OSError as error:
            raise LmserveError(f"model '{name}': cannot read its manifest ({error})") from error
        try:
            manifest = decode_manifest(raw)
        except (ValueError, InvalidRequest, RecursionError) as error:
            raise LmserveError(f"model '{name}': corrupt manifest ({error})") from error
        size = 0
        for digest in manifest.digests:
            try:
                size += self.blob_path(digest).stat().st_size
            except FileNotFoundError:
                raise LmserveError(f"model '{name}': blob {digest} is missing") from None
        return ModelEntry(name=name, manifest=manifest, size=size, digest=hashlib.sha256(raw).hexdigest())

    def _gc_locked(self) -> int:
        referenced: set[str] = set()
        repos: set[str] | None = set()
        """The repos/ directories manifests refer to; None when a manifest could not be read or decoded."""
        num_removed = 0
        is_complete = True
        for path in self._manifest_files():
            if path.name.startswith(TEMP_PREFIX):
                num_removed += remove_if_stale(path)
                continue
            try:  # any digest-looking text counts, so even a corrupt manifest keeps its blobs
                text = path.read_text(errors="replace")
            except OSError as error:
                logger.warning("not collecting blobs: cannot read %s (%s)", path, error)
                is_complete, repos = False, None
                continue
            referenced.update(_DIGEST_IN_TEXT.findall(text))
            repos = add_repository(repos, text)
        for blob in self._blobs.iterdir():
            if blob.name.startswith(TEMP_PREFIX):
                num_removed += remove_if_stale(blob)
            elif is_complete and _BLOB_NAME.fullmatch(blob.name) and blob.name[7:] not in referenced:
                blob.unlink(missing_ok=True)
                num_removed += 1
        return num_removed + self._gc_repos_locked(repos)

    def _gc_repos_locked(self, referenced: set[str] | None) -> int:
        """Remove repos/ directories no manifest refers to (none when `referenced` is unknown) and stale temps."""
        num_removed = 0
        with contextlib.suppress(FileNotFoundError):
            for directory in self._repos.iterdir():
                if directory.name.startswith(TEMP_PREFIX):
                    num_removed += remove_if_stale(directory)
                elif referenced is not None and directory.name not in referenced:
                    remove_tree(directory)
                    num_removed += 1
        return num_removed

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Exclusive flock on root/.lock; each call opens the file, so threads exclude each other too."""
        with open(self.root / ".lock", "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


def _hash(source: BinaryIO, out: BinaryIO | None) -> str:
    """Read `source` to the end in chunks, writing to `out` if given; return `sha256:<hex>`."""
    hasher = hashlib.sha256()
    while chunk := source.read(_CHUNK):
        hasher.update(chunk)
        if out is not None:
            out.write(chunk)
    return "sha256:" + hasher.hexdigest()
