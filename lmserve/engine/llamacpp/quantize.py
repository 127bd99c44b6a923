"""Quantize a GGUF with llama.cpp (`/api/create` with `quantize`): F32/F16/BF16 in, the requested type out.

llama.cpp's `llama_model_quantize` has no progress callback: the caller reports "quantizing …" before and
"success" after. llama.cpp refuses to requantize (a Q4_1 source to Q4_K_M, say), as the local runner does: the
source's `general.file_type` is checked first, so that refusal is a 400 that says why. Any other failure is a 400
carrying llama.cpp's own error line, caught from lmserve's log callback (unless LMSERVE_LLAMA_LOG sends llama.cpp's
log to the console instead).
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp as lc

from lmserve.engine.llamacpp.loading import init_llama_backend
from lmserve.engine.llamacpp.loading import log as llama_log
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

UNQUANTIZED = (lc.LLAMA_FTYPE_ALL_F32, lc.LLAMA_FTYPE_MOSTLY_F16, lc.LLAMA_FTYPE_MOSTLY_BF16)
"""The file types llama.cpp quantizes from; it refuses to requantize anything else."""

_FTYPE_GUESSED = 1024  # llama.cpp's flag on a file type it inferred from the tensors
_FTYPE_NAMES = {
    int(getattr(lc, key)): key.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    for key in dir(lc)
    if key.startswith("LLAMA_FTYPE_") and key != "LLAMA_FTYPE_GUESSED"
}


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


def quantize(source: Path, destination: Path, level: str, *, threads: int | None = None,
             label: str | None = None) -> None:
    """Write `source` quantized to `level` at `destination` (blocking; call it from a worker thread).

    The output goes to a temporary file next to `destination` and is renamed into place only when llama.cpp
    succeeds, so `destination` is never half-written. `threads` defaults to llama.cpp's choice (all cores);
    `label` names the source in errors (the model it came from; the file name by default).
    Raises InvalidRequest (param `quantize`) for an unknown level, a source that is already quantized, or any
    other refusal by llama.cpp (its reason in the message); EngineFailure when the source file is missing.
    """
    ftype = parse_quant(level)
    source, destination = Path(source), Path(destination)
    label = label or source.name
    if not source.is_file():
        raise EngineFailure(f"cannot quantize: model file not found: {source}")
    init_llama_backend()  # ggml's timer and fp16 tables, and llama.cpp's log routed to ours (errors only)
    _check_source(source, label, level)
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads if threads is not None and threads > 0 else 0
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".partial", dir=destination.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with _llama_errors() as errors:
            status = lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        if status != 0:
            reason = "; ".join(errors) or f"status {status}; see the server log"
            raise InvalidRequest(f"llama.cpp could not quantize {label} to {level.strip().upper()}: {reason}",
                                 param="quantize", code="quantize_failed")
        os.replace(tmp, destination)
    finally:
        tmp.unlink(missing_ok=True)


def file_type(path: Path) -> int | None:
    """The GGUF's `general.file_type` (a `LLAMA_FTYPE_*`), read by llama.cpp from the header and vocabulary only;
    None when the file does not say or llama.cpp cannot read it."""
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    try:
        value = ctypes.create_string_buffer(32)
        if lc.llama_model_meta_val_str(model, b"general.file_type", value, len(value)) < 0:
            return None
        text = value.value.decode("ascii", "replace").strip()
        return int(text) & ~_FTYPE_GUESSED if text.isdigit() else None
    finally:
        lc.llama_model_free(model)


def file_type_name(ftype: int) -> str:
    """"Q4_1" for LLAMA_FTYPE_MOSTLY_Q4_1; the number for a type this llama.cpp does not name."""
    return _FTYPE_NAMES.get(ftype, str(ftype))


def _check_source(source: Path, label: str, level: str) -> None:
    """InvalidRequest unless llama.cpp can read `source` and its weights are not quantized already."""
    ftype = file_type(source)
    if ftype is None or ftype in UNQUANTIZED:
        return  # unreadable or unlabelled: llama.cpp itself will say what is wrong
    raise InvalidRequest(
        f"cannot quantize {label} to {level.strip().upper()}: its weights are already quantized "
        f"({file_type_name(ftype)}); quantize from an F32, F16 or BF16 GGUF",
        param="quantize",
        code="already_quantized",
    )


@contextmanager
def _llama_errors() -> Iterator[list[str]]:
    """The error lines llama.cpp logs from this thread while the block runs (through lmserve's log callback)."""
    lines: list[str] = []
    thread = threading.get_ident()

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == thread and record.levelno >= logging.ERROR:
                lines.append(record.getMessage().removeprefix("llama.cpp: ").strip())

    handler = _Collect()
    llama_log.addHandler(handler)
    try:
        yield lines
    finally:
        llama_log.removeHandler(handler)
