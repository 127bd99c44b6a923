"""No orphans: an engine process started by `lmserve serve` ends when the server process does, however it ended.

vLLM starts its engine core (and that its workers) with multiprocessing's `spawn`. Its workers watch the engine
core, but the engine core does not watch the server: after a SIGKILL of the server it would run on, holding the
model's memory. A spawned child imports the parent's main module (lmserve's CLI) before it runs its target; there
`hold_on_to_parent` starts a thread that notices the parent is gone (the child is re-parented) and ends the child
with SIGTERM, so vLLM's own handler stops its workers, then SIGKILL if it has not exited `grace` seconds later.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

POLL_SECONDS = 0.5


def is_spawned_child() -> bool:
    """Whether this process is a multiprocessing child (spawn names it before it imports the main module)."""
    return multiprocessing.current_process().name != "MainProcess"


def hold_on_to_parent(grace: float = 10.0) -> None:
    """In a spawned child: end this process when its parent exits. Elsewhere: nothing."""
    if not is_spawned_child():
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lmserve-lifeline", daemon=True).start()
