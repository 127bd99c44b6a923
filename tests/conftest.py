"""Shared fixtures: the embedded real model (SmolLM2-135M-Instruct), found without any download."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.store.embedded import embedded_model_path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return embedded_model_path()
