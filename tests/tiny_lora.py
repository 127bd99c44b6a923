"""A tiny LoRA adapter GGUF for the tiny llama of `tests.tiny_gguf`, for tests of the Modelfile's ADAPTER.

llama.cpp pairs `<weight>.lora_a` and `<weight>.lora_b` with the base model's `<weight>` and, for a weight of
GGUF shape [n_in, n_out], expects `lora_a` of shape [n_in, rank] and `lora_b` of shape [rank, n_out] (numpy order:
(rank, n_in) and (n_out, rank)); the adapter adds `scale * alpha / rank * B @ A` to the weight's product.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from tests.tiny_gguf import NUM_EMBD, NUM_FF, NUM_HEAD, NUM_HEAD_KV, NUM_LAYER

DEFAULT_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""Per-layer weights the adapter changes (plus `output.weight` when `output=True`)."""

Shapes = Mapping[str, tuple[int, int]]
"""Weight name → (n_out, n_in), numpy order."""


def tiny_llama_shapes(n_vocab: int = 320) -> dict[str, tuple[int, int]]:
    """The 2-D weights of `write_tiny_llama(n_vocab=...)` in numpy order (n_out, n_in)."""
    head_dim = NUM_EMBD // NUM_HEAD
    shapes = {"output.weight": (n_vocab, NUM_EMBD)}
    for i in range(NUM_LAYER):
        shapes |= {
            f"blk.{i}.attn_q.weight": (NUM_HEAD * head_dim, NUM_EMBD),
            f"blk.{i}.attn_k.weight": (NUM_HEAD_KV * head_dim, NUM_EMBD),
            f"blk.{i}.attn_v.weight": (NUM_HEAD_KV * head_dim, NUM_EMBD),
            f"blk.{i}.attn_output.weight": (NUM_EMBD, NUM_HEAD * head_dim),
            f"blk.{i}.ffn_gate.weight": (NUM_FF, NUM_EMBD),
            f"blk.{i}.ffn_up.weight": (NUM_FF, NUM_EMBD),
            f"blk.{i}.ffn_down.weight": (NUM_EMBD, NUM_FF),
        }
    return shapes


def gguf_shapes(path: str | Path) -> dict[str, tuple[int, int]]:
    """The 2-D tensors of a GGUF file in numpy order (n_out, n_in)."""
    reader = gguf.GGUFReader(path)
    return {t.name: (int(t.shape[1]), int(t.shape[0])) for t in reader.tensors if len(t.shape) == 2}


def write_tiny_lora(
    path: str | Path,
    base: str | Path | Shapes | None = None,
    *,
    rank: int = 4,
    scale: float = 0.2,
    alpha: float | None = None,
    seed: int = 1,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    output: bool = True,
    architecture: str = "llama",
) -> Path:
    """Write a LoRA adapter GGUF for `base` (a GGUF path, its shapes, or None: the default tiny llama).

    A and B are seeded normals times `scale`; with the default `alpha = rank` llama.cpp applies B @ A as is, whose
    entries then have a standard deviation of `scale**2 * sqrt(rank)` (0.08 by default, four times the tiny
    llama's own weights), enough to change what the model generates.
    """
    path = Path(path)
    if base is None:
        shapes: Shapes = tiny_llama_shapes()
    elif isinstance(base, (str, Path)):
        shapes = gguf_shapes(base)
    else:
        shapes = base
    wanted = [name for name in shapes if name.startswith("blk.") and name.split(".")[2] in targets]
    if output and "output.weight" in shapes:
        wanted.append("output.weight")
    if not wanted:
        raise ValueError("no base weight matches the adapter's targets")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank if alpha is None else alpha))
    writer.add_name("tiny-lora")
    for name in wanted:
        n_out, n_in = shapes[name]
        writer.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, n_in)) * scale).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", (rng.standard_normal((n_out, rank)) * scale).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
