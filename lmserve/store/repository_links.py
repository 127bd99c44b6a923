"""A repository laid out under repos/ as a directory of relative symlinks to its blobs, named by a hash of its
files map; made and removed whole (renamed into place, renamed away first)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path

from lmserve.errors import InvalidRequest
from lmserve.store.atomic_files import TEMP_PREFIX
from lmserve.store.manifest import decode_manifest


def repository_key(files: Mapping[str, str]) -> str:
    """The name of a repository's directory under repos/: 16 hex digits of the hash of its files map."""
    text = json.dumps(sorted(files.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def add_repository(repos: set[str] | None, manifest_text: str) -> set[str] | None:
    """`repos` plus the directories of the repository and adapter folders a manifest's text describes; None when it
    does not decode."""
    if repos is None:
        return None
    try:
        manifest = decode_manifest(manifest_text.encode())
    except (ValueError, InvalidRequest, RecursionError):
        return None  # a corrupt manifest: its directory cannot be told apart, so keep every directory
    repos.update(repository_key(files) for files in (manifest.files, *manifest.adapter_dirs) if files)
    return repos


def has_links(directory: Path, links: Mapping[str, str]) -> bool:
    """True when `directory` holds exactly these symlinks (relative path → target)."""
    try:
        return all(os.readlink(directory / name) == target for name, target in links.items())
    except OSError:
        return False


def make_links(directory: Path, links: Mapping[str, str]) -> None:
    for name, target in links.items():
        link = directory / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)


def remove_tree(directory: Path) -> None:
    """Remove a repos/ directory: first renamed to a temp name, so nobody sees it half removed."""
    doomed = directory.with_name(f"{TEMP_PREFIX}{secrets.token_hex(8)}")
    os.rename(directory, doomed)
    if doomed.is_dir() and not doomed.is_symlink():
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        doomed.unlink(missing_ok=True)
