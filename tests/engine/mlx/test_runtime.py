"""Importing MLX for the engine (engine/mlx/runtime.py): the device asked for, and OpenBLAS in place of the
reference BLAS that MLX's Linux CPU wheel bundles."""

from __future__ import annotations

import ctypes.util
import importlib.util
import subprocess
import sys

import pytest

from lmserve.engine.mlx.runtime import import_mlx
from lmserve.errors import InvalidRequest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="the MLX engine needs mlx")


def test_the_gpu_asked_for_where_there_is_none_is_refused_naming_the_fix() -> None:
    mx = import_mlx("auto", None)  # the engine's own import first (OpenBLAS under MLX), as when a model loads
    if mx.metal.is_available():
        pytest.skip("this machine has Apple's GPU")
    with pytest.raises(InvalidRequest, match="--mlx-device gpu needs Apple silicon's GPU"):
        import_mlx("gpu", None)
    assert import_mlx("cpu", None).default_device() == mx.cpu


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("openblas") is None,
                    reason="OpenBLAS takes MLX's matrix products on Linux only, where it is installed")
def test_mlx_multiplies_matrices_with_openblas_once_the_engine_imported_it() -> None:
    """In a fresh process (MLX must not be imported before): the engine's import maps OpenBLAS, and MLX's products
    give numpy's answer."""
    script = (
        "from lmserve.engine.mlx.runtime import import_mlx\n"
        "import numpy as np\n"
        "mx = import_mlx('auto', 1)\n"
        "a = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)\n"
        "assert np.allclose(np.array(mx.array(a) @ mx.array(a.T)), a @ a.T, atol=1e-4)\n"
        "print(any('libopenblas' in line for line in open('/proc/self/maps')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("openblas") is None,
                    reason="OpenBLAS takes MLX's matrix products on Linux only, where it is installed")
def test_no_test_module_imports_mlx_before_the_engine_does() -> None:
    """Every MLX test in this process runs with OpenBLAS: test modules check for MLX with find_spec, so the first
    import of MLX is the engine's own (collection imported none)."""
    import_mlx("auto", None)
    with open("/proc/self/maps") as maps:
        assert any("libopenblas" in line for line in maps)
