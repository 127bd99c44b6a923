"""Buffers for the slots' saved states (the prompt cache's entries, engine/slots/prompt_cache.py)."""

from __future__ import annotations

import mmap

from lmserve.engine.slots.prompt_disk import SavedState


def state_buffer(size: int) -> SavedState:
    """A writable buffer of `size` bytes for a saved state: pre-faulted anonymous memory where the platform has
    MAP_POPULATE, else a bytearray."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if not populate or size == 0:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
