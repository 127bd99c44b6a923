"""Pull a model from the Hugging Face hub, with progress, resume and sha256 checks: a GGUF (and its vision
projector), or a safetensors repository.

`pull([hf.co/]<org>/<repo>[:QUANT])` lists the repo's files (`model_info(files_metadata=True)`: sizes and LFS
sha256). A repo with GGUF files gives the GGUF for the quant (`choose_files`, pure); one without GGUFs but with
config.json and safetensors weights gives its repository files (`repository.repository_files`, pure: weights,
configs, tokenizer, chat template). Each file is downloaded into the huggingface_hub cache
(`<cache>/models--org--repo/blobs/<etag>`, with `snapshots/<commit>/<filename>` pointing at it) and verified: LFS
files by sha256, small files (the hub lists no sha256 for them) by size. Registering the files in the lmserve
store is the caller's job.

Resume: huggingface_hub 2.x no longer resumes an interrupted `hf_hub_download` (each attempt writes to a
process-unique temporary file that is deleted on failure), so plain-HTTP downloads go through our own stable
partial file `blobs/<etag>.partial`, resumed with a `Range` request on the next pull; `hf_hub_download` then only
links the finished blob into the snapshot. Xet-backed files (when `hf_xet` is installed) are left to
`hf_hub_download`, which fetches them through Xet (no cross-call resume there). Only huggingface_hub's public
API is used (`tests/test_dependencies.py` checks); `httpx2` is imported for the errors its client raises.

Progress events mirror the local runner's `/api/pull` stream: "pulling manifest", then per file
"pulling <filename>" with digest/total/completed, then "verifying sha256 digest". The caller adds
"writing manifest" and "success" once it has registered the files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2
from filelock import FileLock
from huggingface_hub import HfApi, constants, get_hf_file_metadata, get_session, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoSibling
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status
from huggingface_hub.utils import tqdm as hf_tqdm

from lmserve.errors import InvalidRequest, LmserveError, ModelNotFound, Unreachable
from lmserve.store.names import DEFAULT_TAG, ModelName
from lmserve.store.repository import CONFIG, check_relative_path, repository_files
from lmserve.store.signatures import DIRECTORY_SIGNATURE, FILE_SUFFIX, signed_files

DEFAULT_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "F16")
"""Preference order when the name carries no quant tag (`hf.co/org/repo` or `:latest`)."""

_QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Za-z0-9]+)*|B?F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_CHUNK = 1 << 20
_EMIT_INTERVAL_S = 0.2


@dataclass(slots=True)
class PullProgress:
    """One progress event of a pull, shaped like a line of the local runner's `/api/pull` stream."""

    status: str
    """"pulling manifest", "pulling <file>", "verifying sha256 digest" (the caller adds "success")."""
    digest: str | None = None
    """"sha256:<hex>" of the file being pulled, when known."""
    total: int | None = None
    completed: int | None = None


@dataclass(slots=True)
class PulledFiles:
    """What a pull leaves on disk: paths in the huggingface_hub cache (snapshot symlinks) and verified digests."""

    model: Path
    projector: Path | None
    model_sha256: str
    projector_sha256: str | None


@dataclass(slots=True)
class PulledRepository:
    """What a pull of a safetensors repository leaves on disk: the snapshot folder holding its files (symlinks in
    the huggingface_hub cache) and each file's verified sha256 hex."""

    directory: Path
    sha256: dict[str, str]


ProgressFn = Callable[[PullProgress], None]


def choose_files(filenames: list[str], quant: str | None) -> tuple[str, str | None]:
    """Pick (model GGUF, projector GGUF or None) from a repo's file list. Pure: no I/O.

    `quant` (e.g. "Q4_K_M", any case) must appear in the file name as a whole token: `Q4_K` does not match
    `Q4_K_M`, `F16` does not match `BF16`. Without a quant (None or "latest") the first of Q4_K_M, Q4_0, Q8_0, F16
    that exists wins, else the first GGUF. `mmproj` files are projectors, never models; the projector matching the
    quant is preferred, then F16, then the first. Split GGUFs (`-00001-of-00003.gguf`) are refused.
    Raises InvalidRequest (param `model`) when the repo has no GGUF or none matches, listing what is available.
    """
    ggufs = sorted((f for f in filenames if f.lower().endswith(".gguf")), key=_file_order)
    projectors = [f for f in ggufs if _is_projector(f)]
    models = [f for f in ggufs if not _is_projector(f)]
    if not models:
        raise InvalidRequest("the repository has no GGUF model file", param="model", code="no_gguf")
    wanted = [quant.upper()] if quant and quant.lower() != DEFAULT_TAG else list(DEFAULT_QUANTS)
    for level in wanted:
        matches = [f for f in models if _has_quant(f, level)]
        if matches:
            return _single_file(matches, models), _choose_projector(projectors, level)
    if quant and quant.lower() != DEFAULT_TAG:
        raise InvalidRequest(
            f"no GGUF for quant {quant.upper()}; available: {', '.join(available_quants(models))}",
            param="model",
            code="quant_not_found",
        )
    return _single_file(models, models), _choose_projector(projectors, _quant_of(models[0]))


def available_quants(filenames: list[str]) -> list[str]:
    """The quant labels found in GGUF file names (upper-cased, in order, without repeats); the file name otherwise."""
    labels: list[str] = []
    for name in filenames:
        label = _quant_of(name) or name
        if label not in labels:
            labels.append(label)
    return labels


def pull(
    name: ModelName,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: Path | None = None,
    progress: ProgressFn = lambda p: None,
) -> PulledFiles | PulledRepository:
    """Download `[hf.co/]<org>/<repo>[:QUANT]`: its GGUF for the quant (and its mmproj projector), or, for a repo
    without GGUFs, its safetensors repository; verify every file.

    Blocking; call it from a worker thread. `endpoint` defaults to HF_ENDPOINT / huggingface.co, `token` to the
    stored huggingface token, `cache_dir` to the huggingface_hub cache. A file already in the cache is not
    downloaded again (its digest is still checked); an interrupted plain-HTTP download resumes where it stopped.
    Raises ModelNotFound for a missing (or private without access) repo, InvalidRequest for a name without an
    org, a gated repo, a repo without a matching GGUF or repository files, or a quant tag on a repository,
    LmserveError (500, code `pull_failed` or `digest_mismatch`) for network failures and digest mismatches.
    """
    if name.namespace is None:
        raise InvalidRequest(f"only <org>/<repo> and hf.co/<org>/<repo>[:QUANT] names can be pulled, not '{name}'",
                             param="model")
    repo_id = f"{name.namespace}/{name.name}"
    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    progress(PullProgress("pulling manifest"))
    with _hub_errors(str(name), endpoint):
        info = HfApi(endpoint=endpoint).model_info(repo_id, files_metadata=True, token=token)
    siblings = {s.rfilename: s for s in info.siblings or []}
    source = _Source(repo_id, info.sha or "main", endpoint, token, cache)
    if not any(f.lower().endswith(".gguf") for f in siblings):
        return _pull_repository(source, siblings, name, progress)
    model_file, projector_file = choose_files(list(siblings), name.tag)
    for signature in (f"{model_file}{FILE_SUFFIX}", f"{projector_file}{FILE_SUFFIX}"):
        if signature in siblings:  # it lands beside its file, where the store's check finds it
            _pull_file(source, siblings[signature], str(name), progress)
    model, model_sha = _pull_file(source, siblings[model_file], str(name), progress)
    if projector_file is None:
        return PulledFiles(model, None, model_sha, None)
    projector, projector_sha = _pull_file(source, siblings[projector_file], str(name), progress)
    return PulledFiles(model, projector, model_sha, projector_sha)


def _pull_repository(
    source: _Source, siblings: dict[str, RepoSibling], name: ModelName, progress: ProgressFn
) -> PulledRepository:
    """Fetch and verify the files lmserve keeps of a safetensors repository, config.json first."""
    try:
        filenames = repository_files(siblings)
    except InvalidRequest:
        raise InvalidRequest(f"'{source.repo_id}' has no GGUF file and no config.json with *.safetensors weights: "
                             "nothing lmserve can serve", param="model", code="no_weights") from None
    if name.tag.lower() != DEFAULT_TAG:
        raise InvalidRequest(f"'{source.repo_id}' is a safetensors repository, which has no quant tags: pull it "
                             f"without ':{name.tag}'", param="model", code="quant_not_found")
    paths: dict[str, Path] = {}
    digests: dict[str, str] = {}
    if DIRECTORY_SIGNATURE in siblings:  # signed: the files it covers come too, or it could not verify
        signature, _ = _pull_file(source, siblings[DIRECTORY_SIGNATURE], str(name), progress)
        filenames = [*filenames, *(f for f in signed_files(signature) if f in siblings and f not in filenames)]
    for filename in filenames:
        check_relative_path(filename)
        paths[filename], digests[filename] = _pull_file(source, siblings[filename], str(name), progress)
    return PulledRepository(paths[CONFIG].parent, digests)


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a repo's files come from and go to."""

    repo_id: str
    revision: str
    endpoint: str | None
    token: str | None
    cache_dir: Path

    @property
    def storage(self) -> Path:
        """The repo's folder in the huggingface_hub cache layout: `models--<org>--<repo>`."""
        return self.cache_dir / "--".join(["models", *self.repo_id.split("/")])


def _pull_file(source: _Source, sibling: RepoSibling, model: str, progress: ProgressFn) -> tuple[Path, str]:
    """Fetch one file into the cache, reporting progress; return its snapshot path and verified sha256 hex."""
    filename = sibling.rfilename
    expected = sibling.lfs.sha256.lower() if sibling.lfs is not None else None
    digest = f"sha256:{expected}" if expected else None
    status = f"pulling {filename}"
    with _hub_errors(model, source.endpoint):
        path = _fetch(source, filename, sibling.size, lambda total, n: progress(PullProgress(status, digest, total, n)))
    size = path.stat().st_size
    progress(PullProgress(status, digest, size, size))
    progress(PullProgress("verifying sha256 digest", digest, size, size))
    actual = _sha256(path)
    if expected is not None and actual != expected:
        _discard(path)
        raise LmserveError(
            f"digest mismatch for {filename}: expected sha256:{expected}, got sha256:{actual}; pull again",
            code="digest_mismatch",
        )
    if sibling.size is not None and size != sibling.size:  # small files: the hub lists their size, not a sha256
        _discard(path)
        raise LmserveError(
            f"size mismatch for {filename}: the hub lists {sibling.size} bytes, the download has {size}; pull again",
            code="digest_mismatch",
        )
    return path, actual


def _fetch(source: _Source, filename: str, listed_size: int | None, report: Callable[[int | None, int], None]) -> Path:
    """Download `filename` into the cache unless its blob is there; return its snapshot path."""
    url = hf_hub_url(source.repo_id, filename, revision=source.revision, endpoint=source.endpoint)
    meta = get_hf_file_metadata(url, token=source.token, endpoint=source.endpoint)
    total = meta.size if meta.size is not None else listed_size
    bars = _Reporter(lambda n: report(total, n))
    blob = source.storage / "blobs" / (meta.etag or "unknown")
    partial = blob.with_name(blob.name + ".partial")
    report(total, (total or 0) if blob.is_file() else _size(partial))
    if meta.etag is not None and not blob.is_file() and not _uses_xet(meta.xet_file_data):
        lock = source.cache_dir / ".locks" / source.storage.name / f"{meta.etag}.partial.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):
            _download_resumable(meta.location, url, partial, blob, total, source.token, bars)
    downloaded = hf_hub_download(
        source.repo_id,
        filename,
        revision=source.revision,
        cache_dir=source.cache_dir,
        endpoint=source.endpoint,
        token=source.token,
        tqdm_class=bars.bar_class(),
    )
    return Path(downloaded)


def _download_resumable(
    location: str, url: str, partial: Path, blob: Path, total: int | None, token: str | None, report: _Reporter
) -> None:
    """Append the missing tail of `location` to `partial` (Range request), then move it to `blob`.

    Streams through huggingface_hub's shared HTTP client (`get_session`), so proxies and TLS settings match the
    hub calls. A server that ignores the Range answers 200 with the whole file, which then replaces `partial`.
    """
    if blob.is_file():  # another pull finished it while we waited for the lock
        return
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = _size(partial)
    if total is not None and have > total:
        partial.unlink()
        have = 0
    if total is None or have < total:
        have = _stream_into(location, _download_headers(url, location, token, have), partial, have, report)
    if total is not None and have != total:
        raise LmserveError(
            f"the download of {blob.name} stopped at {have} of {total} bytes; pull again to resume",
            code="pull_failed",
        )
    os.replace(partial, blob)


def _download_headers(url: str, location: str, token: str | None, have: int) -> dict[str, str]:
    """The hub's headers (user agent, token), minus the token for another host, plus a Range to resume from."""
    headers = build_hf_headers(token=token)
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: do not leak the hub token to it
    if have:
        headers["Range"] = f"bytes={have}-"
    return headers


def _stream_into(location: str, headers: dict[str, str], partial: Path, have: int, report: _Reporter) -> int:
    """GET `location` into `partial` (appended on a 206, rewritten otherwise); return the bytes it now holds."""
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with get_session().stream("GET", location, headers=headers, timeout=timeout, follow_redirects=True) as response:
        hf_raise_for_status(response)
        done = have if response.status_code == 206 else 0
        with partial.open("ab" if done else "wb") as file:
            for chunk in response.iter_bytes(_CHUNK):
                file.write(chunk)
                done += len(chunk)
                report.bytes_done(done)
    return done


class _Reporter:
    """Turns byte counts from huggingface_hub's progress bars into throttled `PullProgress` events."""

    def __init__(self, emit: Callable[[int], None]) -> None:
        self._emit = emit
        self._last = 0.0

    def bytes_done(self, completed: int) -> None:
        now = time.monotonic()
        if now - self._last >= _EMIT_INTERVAL_S:
            self._last = now
            self._emit(completed)

    def bar_class(self) -> type[hf_tqdm]:
        """A silent tqdm subclass for `tqdm_class=` that forwards its count here.

        Defining `update_transfer` makes huggingface_hub's Xet reporter use one bar instead of two.
        """
        reporter = self

        class _Bar(hf_tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

            def update(self, n: float | None = 1) -> bool | None:
                if n:
                    self.n += n
                    reporter.bytes_done(int(self.n))
                return None

            def update_transfer(self, n: float | None = 1) -> None:
                """Xet network bytes; `update` already counts the file bytes."""

            def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
                """Part of the aggregated-bar interface huggingface_hub's Xet reporter calls."""

        return _Bar


@contextmanager
def _hub_errors(model: str, endpoint: str | None) -> Iterator[None]:
    """Translate huggingface_hub and network errors into lmserve errors, once, here."""
    try:
        yield
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as error:
        if isinstance(error, GatedRepoError):
            raise InvalidRequest(
                f"model '{model}' is gated: accept its license on the hub and pull with a token",
                param="model",
                code="gated_repo",
            ) from error
        raise ModelNotFound(model) from error
    except OfflineModeIsEnabled as error:
        raise LmserveError(f"cannot pull '{model}': HF_HUB_OFFLINE is set", code="offline") from error
    except HfHubHTTPError as error:
        raise LmserveError(f"pulling '{model}' failed: {error}", code="pull_failed") from error
    except (httpx2.HTTPError, OSError) as error:
        raise _network_failure(model, endpoint, error) from error


def _network_failure(model: str, endpoint: str | None, error: BaseException) -> LmserveError:
    """"could not reach the hub at https://…: name resolution failed (are you offline? …)" when the network
    failed (the socket error under the client's), else the error as it is."""
    reason = _socket_reason(error)
    if reason is None:
        return LmserveError(f"pulling '{model}' failed: {error}", code="pull_failed")
    hub = (endpoint or constants.ENDPOINT).rstrip("/")
    return Unreachable(f"could not reach the hub at {hub}: {reason}", code="hub_unreachable")


def _socket_reason(error: BaseException) -> str | None:
    """What went wrong on the network, from the first socket-level error in `error`'s chain; None if none is."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, socket.gaierror):
            return "name resolution failed (are you offline? set HF_ENDPOINT for a mirror)"
        if isinstance(current, ConnectionRefusedError):
            return "connection refused (is HF_ENDPOINT right?)"
        if isinstance(current, TimeoutError):
            return "timed out (are you offline? set HF_ENDPOINT for a mirror)"
        if isinstance(current, ConnectionError) and current.strerror:
            return current.strerror[:1].lower() + current.strerror[1:]
        current = current.__cause__ or current.__context__
    return None


def _uses_xet(xet_file_data: object | None) -> bool:
    """True when huggingface_hub will fetch this file through Xet rather than plain HTTP."""
    return (
        xet_file_data is not None
        and not constants.HF_HUB_DISABLE_XET
        and importlib.util.find_spec("hf_xet") is not None
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _discard(path: Path) -> None:
    """Remove a bad download (the blob and its snapshot link) so the next pull fetches it again."""
    path.resolve().unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _file_order(filename: str) -> tuple[int, str]:
    """Top-level files first, then by name."""
    return filename.count("/"), filename.lower()


def _is_projector(filename: str) -> bool:
    return "mmproj" in filename.rsplit("/", 1)[-1].lower()


def _has_quant(filename: str, quant: str) -> bool:
    return any(m.group(1).upper() == quant for m in _QUANT_IN_NAME.finditer(filename.rsplit("/", 1)[-1]))


def _quant_of(filename: str) -> str | None:
    matches = list(_QUANT_IN_NAME.finditer(filename.rsplit("/", 1)[-1]))
    return matches[-1].group(1).upper() if matches else None


def _single_file(matches: list[str], models: list[str]) -> str:
    """The first match that is a whole model, not a shard of a split GGUF."""
    whole = [f for f in matches if not _SHARD.search(f)]
    if whole:
        return whole[0]
    raise InvalidRequest(
        f"{matches[0]} is split into several files, which lmserve does not pull; "
        f"available: {', '.join(available_quants(models))}",
        param="model",
        code="split_gguf",
    )


def _choose_projector(projectors: list[str], quant: str | None) -> str | None:
    for level in (quant, "F16"):
        matches = [f for f in projectors if level and _has_quant(f, level)]
        if matches:
            return matches[0]
    return projectors[0] if projectors else None
