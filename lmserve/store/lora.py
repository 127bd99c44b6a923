"""LoRA adapter files checked against their base model before any engine reads them (issue 44).

A GGUF LoRA (llama.cpp's `convert_lora_to_gguf.py` output) has `general.type` "adapter", `adapter.type` "lora", the
base's `general.architecture`, and for each weight `W` of the base it changes, a pair `W.lora_a` and `W.lora_b`: for
a weight of GGUF shape [n_in, n_out], `lora_a` is [n_in, rank] and `lora_b` [rank, n_out]. Anything else is refused
here with a 400 naming what is wrong, so a wrong or corrupt file never reaches llama.cpp (which would fail to load
it, or worse). A PEFT directory (adapter_config.json) is recognised and named: the llama.cpp engine takes GGUF
LoRAs.

Over a safetensors repository (vLLM, MLX) an adapter is a PEFT directory: adapter_config.json (`r`, `lora_alpha`)
and adapter_model.safetensors, whose `<weight>.lora_A.weight` is [rank, n_in] and `lora_B.weight` [n_out, rank] for
a base weight of [n_out, n_in] (names under PEFT's `base_model.model.` prefix). Checked the same way, from the
safetensors headers alone.

Results are kept per (adapter, base) as long as neither file changed (size and mtime), so a request naming an
adapter costs two stats after the first.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from lmserve.errors import InvalidRequest, LmserveError
from lmserve.store.gguf_check import gguf_metadata, gguf_tensor_shapes
from lmserve.store.safetensors_header import safetensors_shapes
from lmserve.types import Adapter

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoraFacts:
    """What a checked adapter is: its rank (the largest of its pairs'), alpha (0: not given) and size on disk."""

    rank: int
    alpha: float
    size: int


_checked: dict[tuple[str, str], tuple[tuple[int, int, int, int], LoraFacts]] = {}
_lock = threading.Lock()


def check_lora(adapter: Path, base: Path, *, max_rank: int = 0, param: str = "lora") -> LoraFacts:
    """The facts of the LoRA at `adapter` for the model at `base` (a GGUF file, or a repository directory: then a
    PEFT directory); InvalidRequest (`param`) naming the file and the reason when it is no LoRA of that kind, was made
    for another architecture or other shapes, or has a rank over `max_rank` (0: no limit)."""
    try:
        stamp = (*_stamp(adapter), *_stamp(base))
    except OSError:
        raise InvalidRequest(f"LoRA adapter not found: {adapter}", param=param) from None
    key = (str(adapter), str(base))
    with _lock:
        cached = _checked.get(key)
    if cached is None or cached[0] != stamp:
        cached = (stamp, _check_peft(adapter, base, param) if base.is_dir() else _check(adapter, base, param))
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
    """Size and modification time of a file; of a directory, those of its adapter weights or its config.json."""
    if path.is_dir():
        path = next((path / name for name in (PEFT_WEIGHTS, "config.json") if (path / name).exists()), path)
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _check_peft(adapter: Path, base: Path, param: str) -> LoraFacts:
    name = adapter.name
    if not (adapter / PEFT_CONFIG).is_file():
        raise InvalidRequest(f"{name} is no PEFT adapter directory (adapter_config.json and {PEFT_WEIGHTS}): this "
                             "engine takes LoRA adapters in PEFT's format", param=param)
    try:
        config = json.loads((adapter / PEFT_CONFIG).read_text())
        rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        raise InvalidRequest(f"LoRA adapter {name}: its {PEFT_CONFIG} is not a JSON object with r and "
                             "lora_alpha", param=param) from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"{name} is a {config.get('peft_type')} adapter, not a LoRA", param=param)
    shapes = safetensors_shapes(adapter / PEFT_WEIGHTS)
    if not shapes:
        raise InvalidRequest(f"LoRA adapter {name}: {PEFT_WEIGHTS} is missing or unreadable", param=param)
    base_shapes: dict[str, tuple[int, ...]] = {}
    for weights in sorted(base.glob("*.safetensors")):
        base_shapes |= {tensor.removesuffix(".weight"): tuple(shape)
                        for tensor, shape in safetensors_shapes(weights).items()}
    renamed = {_gguf_style(tensor): tuple(reversed(shape)) for tensor, shape in shapes.items()}
    found = _check_shapes(name, renamed, {key: tuple(reversed(shape)) for key, shape in base_shapes.items()}, param)
    if rank and found != rank:
        raise InvalidRequest(f"LoRA adapter {name}: its {PEFT_CONFIG} says rank {rank}, its weights {found}",
                             param=param)
    size = sum(file.stat().st_size for file in adapter.iterdir() if file.is_file())
    return LoraFacts(rank=found, alpha=alpha, size=size)


def _gguf_style(tensor: str) -> str:
    """PEFT's `base_model.model.<weight>.lora_A.weight` as `<weight>.lora_a` (the names `_check_shapes` reads)."""
    weight = tensor.removeprefix(PEFT_PREFIX)
    for part, short in ((".lora_A.weight", ".lora_a"), (".lora_B.weight", ".lora_b")):
        if weight.endswith(part):
            return weight.removesuffix(part) + short
    return weight


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
