"""Quantize a GGUF with llama.cpp (`/api/create` with `quantize`): F16/F32 in, the requested type out.

llama.cpp's `llama_model_quantize` has no progress callback: the caller reports "quantizing …" before and
"success" after. llama.cpp's per-tensor log lines go through lmserve's log callback (errors only, unless
LMSERVE_LLAMA_LOG is set).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import llama_cpp as lc

from lmserve.engine.llamacpp import init_llama_backend
from lmserve.errors import EngineFailure, InvalidRequest

QUANT_TYPES: dict[str, int] = {
    "Q4_0": lc.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_1": lc.LLAMA_FTYPE_MOSTLY_Q4_1,
    "Q5_0": lc.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": lc.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q2_K": lc.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q3_K_M": lc.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q4_K_S": lc.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "Q4_K_M": lc.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_S": lc.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    "Q5_K_M": lc.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": lc.LLAMA_FTYPE_MOSTLY_Q6_K,
    "F16": lc.LLAMA_FTYPE_MOSTLY_F16,
    "F32": lc.LLAMA_FTYPE_ALL_F32,
}
"""Accepted quantization levels (upper-case keys; `parse_quant` ignores case) → llama.cpp `LLAMA_FTYPE_*`."""


def parse_quant(level: str) -> int:
    """The llama.cpp file type for a level name such as "q4_K_M"; InvalidRequest (param `quantize`) otherwise."""
    ftype = QUANT_TYPES.get(level.strip().upper())
    if ftype is None:
        raise InvalidRequest(
            f"unsupported quantization level {level!r}; use one of {', '.join(QUANT_TYPES)}",
            param="quantize",
            code="invalid_quantization",
        )
    return ftype


def quantize(source: Path, destination: Path, level: str, *, threads: int | None = None) -> None:
    """Write `source` quantized to `level` at `destination` (blocking; call it from a worker thread).

    The output goes to a temporary file next to `destination` and is renamed into place only when llama.cpp
    succeeds, so `destination` is never half-written. `threads` defaults to llama.cpp's choice (all cores).
    Raises InvalidRequest for an unknown level, EngineFailure when the source is missing or llama.cpp fails
    (for example on a source that is already quantized: requantizing is refused, as the local runner does).
    """
    ftype = parse_quant(level)
    source, destination = Path(source), Path(destination)
    if not source.is_file():
        raise EngineFailure(f"cannot quantize: model file not found: {source}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads if threads is not None and threads > 0 else 0
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".partial", dir=destination.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        init_llama_backend()  # ggml's timer and fp16 tables, and llama.cpp's log routed to ours (errors only)
        status = lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        if status != 0:
            raise EngineFailure(f"llama.cpp could not quantize {source.name} to {level.upper()} (status {status})")
        os.replace(tmp, destination)
    finally:
        tmp.unlink(missing_ok=True)
