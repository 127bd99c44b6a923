"""The schedule through a real `pytest -n 2 --dist loadgroup` run (tests/scheduling.py, tests/conftest.py): modules
that share a server run on one worker, and every worker keeps to its own core (tests/cores.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cores import MACHINE, all_cores

ROOT = Path(__file__).resolve().parent.parent
CONFTEST = f'''
import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
import pytest
from tests.conftest import pytest_collection_modifyitems, pytest_configure, pytest_xdist_make_scheduler

@pytest.fixture(scope="session")
def vllm_engine():
    return os.getpid()

@pytest.fixture
def record(request):
    yield
    out = {{"worker": os.environ["PYTEST_XDIST_WORKER"], "cores": sorted(os.sched_getaffinity(0))}}
    (request.path.parent / (request.path.stem + ".json")).write_text(json.dumps(out))
'''
SHARING = "def test_it(vllm_engine, record):\n    assert vllm_engine\n"
ALONE = "def test_it(record):\n    pass\n"


def test_modules_sharing_a_server_run_on_one_worker_each_worker_on_its_own_core(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    names = {f"test_share_{i}": SHARING for i in range(3)} | {f"test_alone_{i}": ALONE for i in range(3)}
    for name, body in names.items():
        (tmp_path / f"{name}.py").write_text(body)
    with all_cores():  # the inner run is given the machine, as `make test` is
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                               "--dist", "loadgroup", "--rootdir", str(tmp_path), str(tmp_path)],
                              capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    assert len({ran[f"test_share_{i}"]["worker"] for i in range(3)}) == 1, ran
    assert len({r["worker"] for r in ran.values()}) == 2, ran
    cores = {r["worker"]: tuple(r["cores"]) for r in ran.values()}
    if len(MACHINE) >= 2:
        assert len(set(cores.values())) == 2 and all(len(c) == len(MACHINE) // 2 for c in cores.values()), cores
