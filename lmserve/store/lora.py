"""LoRA adapter files checked against their base model before any engine reads them (issue 44).

A GGUF LoRA (llama.cpp's `convert_lora_to_gguf.py` output) has `general.type` "adapter", `adapter.type` "lora", the
base's `general.architecture`, and for each weight `W` of the base it changes, a pair `W.lora_a` and `W.lora_b`: for
a weight of GGUF shape [n_in, n_out], `lora_a` is [n_in, rank] and `lora_b` [rank, n_out]. Anything else is refused
here with a 400 naming what is wrong, so a wrong or corrupt file never reaches llama.cpp (which would fail to load
it, or worse). A PEFT directory (adapter_config.json) is recognised and named: the llama.cpp engine takes GGUF
LoRAs.

Results are kept per (adapter, base) as long as neither file changed (size and mtime), so a request naming an
adapter costs two stats after the first.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from lmserve.errors import InvalidRequest, LmserveError
from lmserve.store.gguf_check import gguf_metadata, gguf_tensor_shapes
from lmserve.types import Adapter

PEFT_CONFIG = "adapter_config.json"


@dataclass(frozen=True, slots=True)
class LoraFacts:
    """What a checked adapter is: its rank (the largest of its pairs'), alpha (0: not given) and size on disk."""

    rank: int
    alpha: float
    size: int


_checked: dict[tuple[str, str], tuple[tuple[int, int, int, int], LoraFacts]] = {}
_lock = threading.Lock()


def check_lora(adapter: Path, base: Path, *, max_rank: int = 0, param: str = "lora") -> LoraFacts:
    """The facts of the LoRA at `adapter` for the GGUF model at `base`; InvalidRequest (`param`) naming the file and
    the reason when it is no LoRA GGUF, was made for another architecture or other shapes, or has a rank over
    `max_rank` (0: no limit)."""
    try:
        stamp = (*_stamp(adapter), *_stamp(base))
    except OSError:
        raise InvalidRequest(f"LoRA adapter not found: {adapter}", param=param) from None
    key = (str(adapter), str(base))
    with _lock:
        cached = _checked.get(key)
    if cached is None or cached[0] != stamp:
        cached = (stamp, _check(adapter, base, param))
        with _lock:
            _checked[key] = cached
    facts = cached[1]
    if max_rank and facts.rank > max_rank:
        raise InvalidRequest(f"LoRA adapter {adapter.name} has rank {facts.rank}, over this server's limit of "
                             f"{max_rank} (--max-lora-rank)", param=param)
    return facts


def file_identity(path: str | Path) -> str:
    """What a cache keys a file by: a store blob's name (its digest), else its resolved path, size and modification
    time (a missing file: its path alone)."""
    path = Path(path)
    if path.name.startswith("sha256-"):
        return path.name
    try:
        size, mtime = _stamp(path)
    except OSError:
        return str(path)
    return f"{path.resolve()}:{size}:{mtime}"


def adapters_identity(adapters: tuple[Adapter, ...]) -> str:
    """A short name for an adapter set as its files are now, with its scales: what a state computed under it is keyed
    by in the prompt cache, on disk across restarts too."""
    parts = [f"{file_identity(adapter.path)}|{adapter.scale!r}" for adapter in adapters]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _check(adapter: Path, base: Path, param: str) -> LoraFacts:
    name = adapter.name
    if adapter.is_dir():
        what = "a PEFT adapter directory" if (adapter / PEFT_CONFIG).is_file() else "a directory"
        raise InvalidRequest(f"{name} is {what}: this engine takes LoRA adapters as GGUF files (convert a PEFT "
                             "adapter with llama.cpp's convert_lora_to_gguf.py)", param=param)
    try:
        metadata = gguf_metadata(adapter)
        shapes = gguf_tensor_shapes(adapter)
    except LmserveError as exc:
        raise InvalidRequest(f"LoRA adapter {name}: {exc.message}", param=param) from None
    if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
        raise InvalidRequest(f"{name} is not a LoRA adapter (its GGUF says general.type "
                             f"{metadata.get('general.type')!r}, adapter.type {metadata.get('adapter.type')!r})",
                             param=param)
    base_metadata = gguf_metadata(base)
    architecture, expected = metadata.get("general.architecture"), base_metadata.get("general.architecture")
    if architecture != expected:
        raise InvalidRequest(f"LoRA adapter {name} is for a {architecture} model, not this {expected} model",
                             param=param)
    rank = _check_shapes(name, shapes, gguf_tensor_shapes(base), param)
    alpha = metadata.get("adapter.lora.alpha")
    return LoraFacts(rank=rank, alpha=float(alpha) if isinstance(alpha, int | float) else 0.0,
                     size=adapter.stat().st_size)


def _check_shapes(name: str, shapes: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]], param: str) -> int:
    """The adapter's rank, once each `lora_a`/`lora_b` pair matches the base weight it changes."""
    weights = {tensor.rsplit(".", 1)[0] for tensor in shapes if tensor.endswith((".lora_a", ".lora_b"))}
    if not weights or any(not tensor.endswith((".lora_a", ".lora_b")) for tensor in shapes):
        raise InvalidRequest(f"LoRA adapter {name} has no lora_a/lora_b tensor pairs", param=param)
    rank = 0
    for weight in sorted(weights):
        a, b, target = shapes.get(f"{weight}.lora_a"), shapes.get(f"{weight}.lora_b"), base.get(weight)
        if a is None or b is None:
            raise InvalidRequest(f"LoRA adapter {name}: {weight} has only one of lora_a and lora_b", param=param)
        if target is None:
            raise InvalidRequest(f"LoRA adapter {name} changes {weight}, which this model does not have (an adapter "
                                 "for another model)", param=param)
        if len(a) != 2 or len(b) != 2 or a[1] != b[0] or a[0] != target[0] or b[1] != target[1]:
            raise InvalidRequest(f"LoRA adapter {name} does not fit this model: {weight} is "
                                 f"{'x'.join(map(str, target))}, its lora_a {'x'.join(map(str, a))} and lora_b "
                                 f"{'x'.join(map(str, b))} (an adapter for another model)", param=param)
        rank = max(rank, a[1])
    return rank
