"""Model store: content-addressed blobs plus one JSON manifest per `name:tag`, under one root directory.

Layout (root from `LMSERVE_MODELS`, default `~/.lmserve/models`):

    blobs/sha256-<hex>                                         GGUF weights, projectors, adapters, repository files
    manifests/<host or "local">/<namespace or "library">/<name>/<tag>      one JSON `Manifest`
    repos/<16 hex digits>/                                     a repository's files as symlinks to their blobs
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lmserve.errors import InvalidRequest, LmserveError, ModelNotFound
from lmserve.store.embedded import removed_hint
from lmserve.store.names import ModelName, parse_name
from lmserve.store.repository import check_relative_path

logger = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
"""A blob digest: `sha256:` and 64 lowercase hex digits (`\\Z`, so no trailing newline slips through)."""
ENV_VAR = "LMSERVE_MODELS"
DEFAULT_ROOT = "~/.lmserve/models"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 3600.0
SCHEMA_VERSION = 1
_DIGEST_IN_TEXT = re.compile(r"sha256:([0-9a-f]{64})")
_BLOB_NAME = re.compile(r"sha256-[0-9a-f]{64}")
_LOCAL_HOST = "local"
_DEFAULT_NAMESPACE = "library"
_CHUNK = 1 << 20


def check_digest(digest: str) -> str:
    """Return `digest` if it is `sha256:` + 64 lowercase hex digits; else raise InvalidRequest naming the rule."""
    if DIGEST_RE.match(digest):
        return digest
    hex_part = digest.removeprefix("sha256:")
    if not digest.startswith("sha256:"):
        rule = "a digest starts with 'sha256:'"
    elif len(hex_part) != 64:
        rule = f"'sha256:' is followed by exactly 64 hex digits, not {len(hex_part)} characters"
    else:
        rule = "the 64 hex digits are lowercase 0-9 and a-f only"
    raise InvalidRequest(f"invalid digest {digest[:80]!r}: {rule}", param="digest")


@dataclass(slots=True)
class Manifest:
    """One model: which blobs it is made of, and what its Modelfile added on top of the GGUF."""

    model: str
    """Blob digest of the GGUF weights; for a repository, of its config.json."""
    projector: str | None = None
    """Blob digest of an mmproj GGUF (vision projector)."""
    adapters: list[str] = field(default_factory=list)
    """Blob digests of LoRA GGUFs."""
    template: str | None = None
    """Go template text from a Modelfile; None = use the GGUF's own chat template."""
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[tuple[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    parent: str = ""
    """The name this model was created FROM (details.parent_model)."""
    details: dict[str, Any] = field(default_factory=dict)
    """format, family, families, parameter_size, quantization_level."""
    modified_at: float = 0.0
    """Unix seconds; set by `Store.save`."""
    files: dict[str, str] = field(default_factory=dict)
    """A repository's files: relative path → blob digest (config.json's is `model`); empty for a GGUF model."""

    @property
    def digests(self) -> list[str]:
        """Every blob digest this manifest refers to, once each: model, projector, adapters, repository files."""
        projector = [] if self.projector is None else [self.projector]
        return list(dict.fromkeys([self.model, *projector, *self.adapters, *self.files.values()]))


@dataclass(slots=True)
class ModelEntry:
    """A stored model as listed: its name, manifest, total blob bytes and manifest digest."""

    name: ModelName
    manifest: Manifest
    size: int
    """Total bytes of its blobs."""
    digest: str
    """sha256 hex of the manifest file's bytes (like the local runner's model digest; no `sha256:` prefix)."""


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
        directory = self._repos / repository_key(manifest.files)
        links = {name: self._link_target(directory, name, digest) for name, digest in manifest.files.items()}
        with self._lock():
            if not _has_links(directory, links):
                if os.path.lexists(directory):
                    _remove_tree(directory)
                self._repos.mkdir(exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=self._repos, prefix=TEMP_PREFIX))
                try:
                    _make_links(tmp, links)
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
            manifest = _decode(raw)
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
                num_removed += _remove_if_stale(path)
                continue
            try:  # any digest-looking text counts, so even a corrupt manifest keeps its blobs
                text = path.read_text(errors="replace")
            except OSError as error:
                logger.warning("not collecting blobs: cannot read %s (%s)", path, error)
                is_complete, repos = False, None
                continue
            referenced.update(_DIGEST_IN_TEXT.findall(text))
            repos = _add_repository(repos, text)
        for blob in self._blobs.iterdir():
            if blob.name.startswith(TEMP_PREFIX):
                num_removed += _remove_if_stale(blob)
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
                    num_removed += _remove_if_stale(directory)
                elif referenced is not None and directory.name not in referenced:
                    _remove_tree(directory)
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


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary sibling, flushed to disk, renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _remove_if_stale(path: Path) -> int:
    """Remove a temp file (or directory) whose inode changed over an hour ago (ctime: a fresh hard link counts as
    new)."""
    try:
        if time.time() - path.lstat().st_ctime < STALE_TEMP_SECONDS:
            return 0
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError:
        return 0
    return 1


def repository_key(files: Mapping[str, str]) -> str:
    """The name of a repository's directory under repos/: 16 hex digits of the hash of its files map."""
    text = json.dumps(sorted(files.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _add_repository(repos: set[str] | None, manifest_text: str) -> set[str] | None:
    """`repos` plus the directory of the repository a manifest's text describes; None when it does not decode."""
    if repos is None:
        return None
    try:
        files = _decode(manifest_text.encode()).files
    except (ValueError, InvalidRequest, RecursionError):
        return None  # a corrupt manifest: its directory cannot be told apart, so keep every directory
    if files:
        repos.add(repository_key(files))
    return repos


def _has_links(directory: Path, links: Mapping[str, str]) -> bool:
    """True when `directory` holds exactly these symlinks (relative path → target)."""
    try:
        return all(os.readlink(directory / name) == target for name, target in links.items())
    except OSError:
        return False


def _make_links(directory: Path, links: Mapping[str, str]) -> None:
    for name, target in links.items():
        link = directory / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)


def _remove_tree(directory: Path) -> None:
    """Remove a repos/ directory: first renamed to a temp name, so nobody sees it half removed."""
    doomed = directory.with_name(f"{TEMP_PREFIX}{secrets.token_hex(8)}")
    os.rename(directory, doomed)
    if doomed.is_dir() and not doomed.is_symlink():
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        doomed.unlink(missing_ok=True)


def _decode(raw: bytes) -> Manifest:
    """Parse and check a manifest file; ValueError or InvalidRequest on anything unexpected."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")

    def typed(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = data.get(key, default)
        if not isinstance(value, kind) or (isinstance(value, bool) and key == "modified_at"):
            raise ValueError(f"{key!r} has the wrong type")
        return value

    projector = typed("projector", (str, type(None)), None)
    adapters = typed("adapters", list, [])
    files = typed("files", dict, {})
    if not all(isinstance(digest, str) for digest in files.values()):
        raise ValueError("'files' must map file names to digests")
    messages = typed("messages", list, [])
    licenses = typed("license", list, [])
    if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m) for m in messages):
        raise ValueError("'messages' must be [role, content] pairs")
    if not all(isinstance(text, str) for text in [*adapters, *licenses]):
        raise ValueError("'adapters' and 'license' must be lists of strings")
    return Manifest(
        model=check_digest(typed("model", str, None)),
        projector=None if projector is None else check_digest(projector),
        adapters=[check_digest(adapter) for adapter in adapters],
        template=typed("template", (str, type(None)), None),
        system=typed("system", (str, type(None)), None),
        parameters=typed("parameters", dict, {}),
        messages=[(role, content) for role, content in messages],
        license=licenses,
        parent=typed("parent", str, ""),
        details=typed("details", dict, {}),
        modified_at=float(typed("modified_at", (int, float), 0.0)),
        files={check_relative_path(name): check_digest(digest) for name, digest in files.items()},
    )
