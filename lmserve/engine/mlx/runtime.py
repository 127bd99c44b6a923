"""Importing MLX for the engine: where it computes, and which BLAS its CPU build multiplies matrices with.

MLX's Linux CPU wheel (`mlx[cpu]`) links the reference BLAS it bundles, about 25x slower than OpenBLAS at the
matrix products a model is made of (measured here: a 256x576 by 576x576 product in 109 ms, 3.8 ms with OpenBLAS).
Its matrix products call `cblas_sgemm` by name, so an OpenBLAS loaded into the global symbol scope before MLX is
imported takes those calls. On macOS MLX uses Apple's Accelerate and Metal, and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Any

from lmserve.errors import InvalidRequest

log = logging.getLogger("lmserve.engine.mlx")

OPENBLAS_HINT = "apt-get install libopenblas0-pthread"


def import_mlx(device: str, threads: int | None) -> Any:
    """`mlx.core`, computing on `device` (auto, gpu or cpu); InvalidRequest when the GPU is asked for and absent."""
    if sys.platform.startswith("linux") and "mlx.core" not in sys.modules:
        use_openblas(threads)
    import mlx.core as mx

    if device == "gpu":
        if not mx.metal.is_available():
            raise InvalidRequest("--mlx-device gpu needs Apple silicon's GPU (Metal), and this machine has none: "
                                 "use --mlx-device cpu or auto", param="model")
        mx.set_default_device(mx.gpu)
    elif device == "cpu":
        mx.set_default_device(mx.cpu)
    return mx


def use_openblas(threads: int | None) -> bool:
    """Load OpenBLAS into the global symbol scope (before MLX); False, with a warning, where it is not installed."""
    name = ctypes.util.find_library("openblas")
    if name is None:
        log.warning("MLX's CPU build multiplies matrices with the reference BLAS here, about 25x slower than "
                    "OpenBLAS: install it (%s)", OPENBLAS_HINT)
        return False
    library = ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    if threads:
        library.openblas_set_num_threads(ctypes.c_int(threads))
    return True
