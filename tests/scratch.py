"""One scratch folder per test process, removed when the process exits: the stores of the servers tests start and
vLLM's IPC sockets go there, not loose in /tmp, where each run left ~100 stores (up to 260 MB each) and the sockets
of every server it killed."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(tempfile.mkdtemp(prefix="lmserve-tests-"))
atexit.register(shutil.rmtree, ROOT, True)


def store() -> str:
    """A fresh, empty model store (LMSERVE_MODELS) under the scratch folder."""
    return tempfile.mkdtemp(prefix="store-", dir=ROOT)


def keep_sockets_here() -> None:
    """vLLM's engines, in this process and in the servers it starts, open their IPC sockets under the scratch
    folder (a short path: a socket's must fit in 107 bytes)."""
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(ROOT))
