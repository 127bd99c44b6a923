"""Loads that crashed the server process: the same weights are refused, with the reason, until they change or the
window has passed; a load that returns leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.errors import EngineFailure
from lmserve.store.load_crashes import LoadCrashes

CRASH_WHILE_LOADING = """
import os, pathlib, signal, sys
from lmserve.store.load_crashes import LoadCrashes
with LoadCrashes(pathlib.Path(sys.argv[1])).loading("crasher", pathlib.Path(sys.argv[2])):
    os.kill(os.getpid(), signal.SIGSEGV)
"""


def crash_while_loading(directory: Path, weights: Path) -> int:
    """Run a process that dies of SIGSEGV while it loads `weights`; its pid."""
    process = subprocess.Popen([sys.executable, "-c", CRASH_WHILE_LOADING, str(directory), str(weights)])
    assert process.wait() == -11
    return process.pid


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    return path


def test_a_load_that_returns_leaves_no_marker(tmp_path: Path, weights: Path) -> None:
    crashes = LoadCrashes(tmp_path / "markers")
    with crashes.loading("model", weights):
        [marker] = (tmp_path / "markers").iterdir()
        assert '"model": "model"' in marker.read_text()
        with crashes.loading("model", weights):  # a load in a live process is no crash
            pass
    with pytest.raises(ValueError), crashes.loading("model", weights):
        raise ValueError("the load failed")
    assert list((tmp_path / "markers").iterdir()) == []


def test_weights_whose_load_crashed_the_process_are_refused_naming_the_signal(tmp_path: Path,
                                                                              weights: Path) -> None:
    crashes = LoadCrashes(tmp_path / "markers")
    crashes.died(crash_while_loading(tmp_path / "markers", weights), "SIGSEGV")
    with pytest.raises(EngineFailure, match=r"^loading it crashed the server process \(SIGSEGV\) at \d{4}-\d\d-\d\d "
                                            r"\d\d:\d\d:\d\d UTC; it is not loaded again until its weights change or "
                                            r"10 minutes have passed$"), crashes.loading("crasher", weights):
        pytest.fail("loaded again")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other weights")
    with crashes.loading("other", other):  # other weights load
        pass


def test_a_crash_is_forgotten_when_the_weights_change_or_the_window_has_passed(tmp_path: Path,
                                                                               weights: Path) -> None:
    crash_while_loading(tmp_path / "markers", weights)
    with LoadCrashes(tmp_path / "markers", window=0).loading("crasher", weights):
        pass
    crash_while_loading(tmp_path / "markers", weights)
    weights.write_bytes(b"new weights")
    with LoadCrashes(tmp_path / "markers").loading("crasher", weights):
        pass
    assert list((tmp_path / "markers").iterdir()) == []


def test_loading_other_weights_keeps_the_record_of_a_crash(tmp_path: Path, weights: Path) -> None:
    crash_while_loading(tmp_path / "markers", weights)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other weights")
    crashes = LoadCrashes(tmp_path / "markers")
    with crashes.loading("other", other):
        pass
    with pytest.raises(EngineFailure, match=r"^loading it crashed the server process at "), \
            crashes.loading("crasher", weights):
        pytest.fail("loaded again")
