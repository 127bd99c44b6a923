"""What a GGUF model's KV cache costs per token on llama.cpp, and the memory it has for it: the facts behind a
llama.cpp load's context choice (engine/context_size.py).

One token of one sequence keeps, in every attention layer, `head_count_kv` heads of `key_length` values for the
keys and `value_length` for the values, each in the cache type (`--cache-type-k/-v`). A hybrid model's layers
differ (LFM2's convolutions keep none): the per-layer `<arch>.attention.head_count_kv` array, which llama.cpp's
metadata API leaves out, is read from the file's header. Sliding-window layers are counted whole (an upper bound).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import gguf
import llama_cpp as lc

from lmserve.engine.context_size import ContextChoice, choose_context, machine_memory, memory_beside
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.types import LoadOptions

log = logging.getLogger(__name__)

KV_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "iq4_nl": 18 / 32,
    "q5_0": 22 / 32, "q5_1": 24 / 32,
}  # fmt: skip
"""Bytes per cached value of each KV cache type (options.KV_CACHE_TYPES): a quantized block of 32 values and its
scales."""
_GPU_DEVICE_TYPES = (1, 2)
"""ggml_backend_dev_type values of a discrete and an integrated GPU."""


def context_choice(model: lc.llama_model_p, path: Path, options: LoadOptions,
                   launch: LlamaCppLaunch) -> ContextChoice:
    """The context per sequence of a llama.cpp load of the model at `path` (loaded as `model`) with `options`."""
    slots = 1 if launch.kv_unified else options.num_parallel
    weights = lc.llama_model_size(model)
    on_gpu = gpu_free_memory() if options.num_gpu_layers != 0 else None
    memory = on_gpu if on_gpu is not None else memory_beside(weights, machine_memory())
    try:
        kv_bytes = kv_bytes_per_token(model, path, launch)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:  # metadata this reader cannot use
        log.warning("%s: the KV cache's size per token could not be read (%s); counting every layer as attention",
                    path.name, exc)
        kv_bytes = _every_layer_attention(model, launch)
    return choose_context(options.num_ctx, trained=lc.llama_model_n_ctx_train(model), kv_bytes_per_token=kv_bytes,
                          num_slots=slots, memory_bytes=memory)


def _every_layer_attention(model: lc.llama_model_p, launch: LlamaCppLaunch) -> int:
    """An upper bound of one token's KV cache: every layer an attention layer with the model's KV heads."""
    heads = max(lc.llama_model_n_head(model), 1)
    head_dim = lc.llama_model_n_embd(model) // heads
    kv_heads = max(lc.llama_model_n_head_kv(model), 1) * lc.llama_model_n_layer(model)
    return int(kv_heads * head_dim * (KV_TYPE_BYTES[launch.cache_type_k] + KV_TYPE_BYTES[launch.cache_type_v]))


def kv_bytes_per_token(model: lc.llama_model_p, path: Path, launch: LlamaCppLaunch) -> int:
    """One token's KV cache in one sequence, in bytes (0 when the model keeps none per token)."""
    heads = lc.llama_model_n_head(model)
    head_dim = lc.llama_model_n_embd(model) // heads if heads > 0 else 0
    architecture = _meta(model, "general.architecture")
    key_dim = int(_meta(model, f"{architecture}.attention.key_length") or head_dim)
    value_dim = int(_meta(model, f"{architecture}.attention.value_length") or head_dim)
    if lc.llama_model_is_hybrid(model) or lc.llama_model_is_recurrent(model):
        kv_heads = _kv_heads_per_layer(path, architecture)
    else:
        kv_heads = [lc.llama_model_n_head_kv(model)] * lc.llama_model_n_layer(model)
    per_value = sum(kv_heads) * (key_dim * KV_TYPE_BYTES[launch.cache_type_k]
                                 + value_dim * KV_TYPE_BYTES[launch.cache_type_v])
    return int(per_value)


def gpu_free_memory() -> int | None:
    """Free memory of the GPUs llama.cpp sees, in bytes (after what is loaded on them); None without a GPU."""
    libggml = _libggml()
    if libggml is None:
        return None
    libggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    libggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    libggml.ggml_backend_dev_type.restype = ctypes.c_int
    libggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_dev_memory.restype = None
    libggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.POINTER(ctypes.c_size_t)]
    free_total = 0
    found = False
    for index in range(libggml.ggml_backend_dev_count()):
        device = libggml.ggml_backend_dev_get(index)
        if libggml.ggml_backend_dev_type(device) not in _GPU_DEVICE_TYPES:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        libggml.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        free_total += free.value
        found = True
    return free_total if found else None


def _libggml() -> ctypes.CDLL | None:
    """ggml's library as llama-cpp-python ships it (loaded already: this finds the same handle), or None."""
    folder = Path(lc.__file__).parent / "lib"
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        if (folder / name).is_file():
            return ctypes.CDLL(str(folder / name))
    return None


def _kv_heads_per_layer(path: Path, architecture: str) -> list[int]:
    """`<arch>.attention.head_count_kv` of each layer, read from the file's header (one number: every layer)."""
    reader = gguf.GGUFReader(path, "r")
    field = reader.fields.get(f"{architecture}.attention.head_count_kv")
    blocks = reader.fields.get(f"{architecture}.block_count")
    if field is None:
        return []
    value = field.contents()
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)] * (int(blocks.contents()) if blocks is not None else 1)


def _meta(model: lc.llama_model_p, key: str) -> str:
    """One metadata value as text ("" when absent)."""
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""
