"""Fixtures of the vLLM engine's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture
def environment() -> Iterator[None]:
    """vLLM's platform check writes os.environ (LD_PRELOAD, LOCAL_WORLD_SIZE): put it back for later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
