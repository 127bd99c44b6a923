"""Files written whole or not at all (a temporary sibling, flushed, renamed into place), and the removal of
temporaries a crash left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

TEMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 3600.0


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


def remove_if_stale(path: Path) -> int:
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
