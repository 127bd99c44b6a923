"""Loading a GGUF into llama.cpp: the library's start, the model, the slots' context, its LoRA adapters, and what the
model's metadata says about it.

`LlamaModel` owns the handles the backend decodes with (engine/llamacpp/backend.py) and frees them together. Each
slot is a llama.cpp sequence id with its own KV stream (`kv_unified = false`), or with `--kv-unified` the slots
share one pool of `num_ctx` cells (each may grow to all of it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp as lc
from llama_cpp import mtmd_cpp as mtmd

from lmserve.engine import fim
from lmserve.engine.context_size import ContextChoice
from lmserve.engine.llamacpp import rerank
from lmserve.engine.llamacpp.adapters import DEFAULT_MAX_LOADED, AdapterPool
from lmserve.engine.llamacpp.memory import context_choice, kv_bytes_per_token
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.llamacpp.vision import Vision
from lmserve.engine.protocol import FimTokens, ModelInfo
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import AUTO_CONTEXT, LoadOptions

log = logging.getLogger(__name__)

_GGML_LOG_LEVEL_ERROR = 4
_backend_lock = threading.Lock()
_backend_ready = False


def init_llama_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            if not os.environ.get("LMSERVE_LLAMA_LOG"):
                lc.llama_log_set(_silent_log, ctypes.c_void_p(0))
                mtmd.mtmd_log_set(_silent_log, ctypes.c_void_p(0))
                mtmd.mtmd_helper_log_set(_silent_log, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _backend_ready = True


_HANDLED_ERRORS = ("failed to prepare attention ubatches",)
"""llama.cpp errors the engine handles: a hybrid model's batch finding no room in a shared KV pool (PoolFull)."""


@lc.llama_log_callback  # type: ignore[untyped-decorator]
def _silent_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR:
        message = text.decode("utf-8", "replace").rstrip()
        log.log(logging.DEBUG if any(part in message for part in _HANDLED_ERRORS) else logging.ERROR,
                "llama.cpp: %s", message)


GGML_TYPES = {
    "f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0,
    "q4_1": lc.GGML_TYPE_Q4_1, "iq4_nl": lc.GGML_TYPE_IQ4_NL, "q5_0": lc.GGML_TYPE_Q5_0, "q5_1": lc.GGML_TYPE_Q5_1,
}
"""types.KV_CACHE_TYPES as ggml's type ids."""
FLASH_ATTN_TYPES = {"on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                    "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO}


def check_kv_options(launch: LlamaCppLaunch) -> None:
    """InvalidRequest for a KV cache type or flash-attention mode llama.cpp does not take, or a quantized value
    cache with flash attention off (llama.cpp reads quantized values only in its flash-attention kernels)."""
    for name, value in (("--cache-type-k", launch.cache_type_k), ("--cache-type-v", launch.cache_type_v)):
        if value not in GGML_TYPES:
            raise InvalidRequest(f"{name} {value} is not a KV cache type; choose one of {', '.join(GGML_TYPES)}")
    if launch.flash_attn not in FLASH_ATTN_TYPES:
        raise InvalidRequest(f"--flash-attn {launch.flash_attn}: choose on, off or auto")
    if launch.flash_attn == "off" and launch.cache_type_v not in ("f16", "f32"):
        raise InvalidRequest(f"--cache-type-v {launch.cache_type_v} needs flash attention: drop --flash-attn off")


GPU_PLACEMENT = frozenset({"num_gpu_layers", "main_gpu"})
"""The load options that place layers on a GPU: inert on a llama.cpp built without GPU offload."""


def load_mode(options: LoadOptions) -> int:
    """llama.cpp's load mode for use_mmap (None: its own choice) and use_mlock."""
    if options.use_mlock:
        return lc.LLAMA_LOAD_MODE_MLOCK if options.use_mmap is False else lc.LLAMA_LOAD_MODE_MMAP_MLOCK
    if options.use_mmap is None:
        return lc.LLAMA_LOAD_MODE_AUTO
    return lc.LLAMA_LOAD_MODE_MMAP if options.use_mmap else lc.LLAMA_LOAD_MODE_NONE


def _load_model(path: Path, options: LoadOptions) -> Any:
    """The model at `path` (a llama_model pointer), its layers placed as `options` say."""
    if not path.is_file():
        raise EngineFailure(f"model file not found: {path}")
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = options.num_gpu_layers
    mparams.main_gpu = options.main_gpu
    mparams.load_mode = load_mode(options)
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise EngineFailure(f"llama.cpp could not load {path.name}: not a valid GGUF model")
    return model


def _slots_params(options: LoadOptions, launch: LlamaCppLaunch, num_ctx: int, threads: int) -> Any:
    """The llama_context_params of the slots' context (a llama_context_params struct)."""
    cparams = lc.llama_context_default_params()
    cparams.n_seq_max = options.num_parallel
    # One pool of num_ctx tokens for all slots (each may grow to all of it, as llama-server's -c with
    # --kv-unified), or num_ctx tokens of its own per slot.
    cparams.n_ctx = num_ctx if launch.kv_unified else num_ctx * options.num_parallel
    cparams.n_batch = options.num_batch
    cparams.n_ubatch = options.num_batch
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = launch.kv_unified
    cparams.type_k = GGML_TYPES[launch.cache_type_k]
    cparams.type_v = GGML_TYPES[launch.cache_type_v]
    cparams.flash_attn_type = FLASH_ATTN_TYPES[launch.flash_attn]
    cparams.no_perf = True
    return cparams


class LlamaModel:
    """A GGUF loaded in llama.cpp: the model, its vocabulary, the slots' context with its batch, and its LoRA
    adapters (engine/llamacpp/adapters.py; `adapter_limits`: most loaded at once, highest rank, 0: any);
    `close` frees them in order."""

    def __init__(self, path: Path, options: LoadOptions, launch: LlamaCppLaunch, threads: int,
                 adapter_limits: tuple[int, int] = (DEFAULT_MAX_LOADED, 0)) -> None:
        model = _load_model(path, options)
        self.model: Any = model  # a llama_model pointer; None once closed
        self.vocab = lc.llama_model_get_vocab(model)
        # Auto, or what was asked (untrusted from a request) but never more than the model was trained for.
        self.choice: ContextChoice = context_choice(model, path, options, launch)
        self.is_reranker = rerank.is_reranker(model)
        self.num_ctx = rerank.context_size(self.choice.num_ctx, auto=options.num_ctx == AUTO_CONTEXT) \
            if self.is_reranker else self.choice.num_ctx
        """Each sequence's context as asked of llama.cpp."""
        cparams = _slots_params(options, launch, self.num_ctx, threads)
        if self.is_reranker:  # its context ranks pairs and generates nothing (the engine refuses prompts)
            rerank.configure(cparams, self.num_ctx, bidirectional=rerank.is_bidirectional(model),
                             flash_attn=launch.flash_attn)
        self._cparams = cparams
        self._kv_cell_bytes = kv_bytes_per_token(model, path, launch)
        self.held_bytes = (lc.llama_model_size(model), 0)
        """The weights' tensors and the slots' KV cache as allocated (0 while the context is freed), in bytes: plain
        numbers, read from any thread."""
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            lc.llama_model_free(model)
            kv = f" with a {launch.cache_type_k}/{launch.cache_type_v} KV cache and flash attention " \
                 f"{launch.flash_attn}" if (launch.cache_type_k, launch.cache_type_v) != ("f16", "f16") else ""
            raise EngineFailure(f"llama.cpp could not create a context of {cparams.n_ctx} tokens for {path.name}{kv}")
        self.ctx: Any = ctx  # a llama_context pointer; None once closed
        self.held_bytes = (self.held_bytes[0], self._kv_cell_bytes * lc.llama_n_ctx(ctx))
        self.adapters = AdapterPool(model, path, max_loaded=adapter_limits[0], max_rank=adapter_limits[1])
        try:
            self.adapters.load_defaults(options.adapters)
            self.adapters.apply(ctx, ())
        except EngineFailure:
            self.adapters.close()
            lc.llama_free(ctx)
            lc.llama_model_free(model)
            raise
        self.num_vocab: int = lc.llama_vocab_n_tokens(self.vocab)
        self.eog = frozenset(t for t in range(self.num_vocab) if lc.llama_vocab_is_eog(self.vocab, t))
        self.memory = lc.llama_get_memory(ctx)
        self.batch_capacity: int = cparams.n_batch if self.is_reranker else options.num_batch
        self.batch = lc.llama_batch_init(self.batch_capacity, 0, 1)

    def free_context(self) -> None:
        """Free the slots' context (their KV cache) and batch; the model and adapters stay (sleep level 1)."""
        if self.ctx:
            self.held_bytes = (self.held_bytes[0], 0)
            lc.llama_batch_free(self.batch)
            self.adapters.forget(self.ctx)
            lc.llama_free(self.ctx)
            self.ctx = None

    def new_context(self) -> None:
        """Make the slots' context and batch again after `free_context`, as they were made at load, empty."""
        ctx = lc.llama_init_from_model(self.model, self._cparams)
        if not ctx:
            raise EngineFailure(f"llama.cpp could not make the context of {self._cparams.n_ctx} tokens again")
        self.ctx, self.memory = ctx, lc.llama_get_memory(ctx)
        self.adapters.apply(ctx, ())
        self.batch = lc.llama_batch_init(self.batch_capacity, 0, 1)
        self.held_bytes = (self.held_bytes[0], self._kv_cell_bytes * lc.llama_n_ctx(ctx))

    def close(self) -> None:
        """Free the slots' context, then the adapters, then the model (any other context of the model first)."""
        self.free_context()
        self.adapters.close()  # after every context using them, before the model
        if self.model:
            self.held_bytes = (0, 0)
            lc.llama_model_free(self.model)
            self.model = None

    # ---- what the model says about itself --------------------------------------------------------

    def model_info(self, path: Path, options: LoadOptions, *, vision: Vision | None,
                   draft_model: str | None) -> ModelInfo:
        """The loaded model as the engine describes it (engine/protocol.py)."""
        ctx, model = self.ctx, self.model
        metadata = self.metadata()
        return ModelInfo(
            path=str(path),
            architecture=metadata.get("general.architecture", ""),
            # a reranker's pair is decoded in one micro-batch
            num_ctx=min(lc.llama_n_ctx_seq(ctx), lc.llama_n_ubatch(ctx)) if self.is_reranker
            else lc.llama_n_ctx_seq(ctx),
            num_parallel=options.num_parallel,
            num_vocab=self.num_vocab,
            num_ctx_train=self.choice.trained,
            chat_template=self.chat_template(),
            bos_token=self.token_text(lc.llama_vocab_bos(self.vocab)),
            eos_token=self.token_text(lc.llama_vocab_eos(self.vocab)),
            size_bytes=lc.llama_model_size(model),
            num_params=lc.llama_model_n_params(model),
            description=self.description(),
            metadata=metadata,
            image_marker=vision.marker if vision is not None and vision.sees_images else None,
            audio_marker=vision.marker if vision is not None and vision.audio_rate > 0 else None,
            audio_rate=vision.audio_rate if vision is not None else 0,
            can_cut_memory=not (lc.llama_model_is_hybrid(model) or lc.llama_model_is_recurrent(model)),
            fim=self.fim_tokens(),
            draft_model=draft_model,
            num_kv_cells=lc.llama_n_ctx(ctx),
            can_rank=self.is_reranker,
            can_embed=not self.is_reranker,
            inert_load_options=frozenset() if lc.llama_supports_gpu_offload() else GPU_PLACEMENT,
        )

    def tokenize_raw(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """llama.cpp's tokens of `text`, as they come (llama-server's `common_tokenize`)."""
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = lc.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", "replace") if text else ""

    def fim_tokens(self) -> FimTokens | None:
        """The FIM tokens llama.cpp found (GGUF `tokenizer.ggml.fim_*_token_id`, the older prefix/suffix/middle keys,
        or known token texts)."""
        v = self.vocab
        return fim.from_ids(lc.llama_vocab_fim_pre(v), lc.llama_vocab_fim_suf(v), lc.llama_vocab_fim_mid(v),
                            lc.llama_vocab_fim_rep(v), lc.llama_vocab_fim_sep(v))

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_desc(self.model, buf, len(buf))
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        template = lc.llama_model_chat_template(self.model, None)
        return template.decode("utf-8", "replace") if template else None

    def metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(1024)
        for i in range(lc.llama_model_meta_count(self.model)):
            n = lc.llama_model_meta_key_by_index(self.model, i, buf, len(buf))
            if n < 0:
                continue
            key = buf.raw[: min(n, len(buf) - 1)].decode("utf-8", "replace")
            n = lc.llama_model_meta_val_str_by_index(self.model, i, buf, len(buf))
            if n < 0:
                continue
            if n >= len(buf):
                big = ctypes.create_string_buffer(n + 1)
                lc.llama_model_meta_val_str_by_index(self.model, i, big, len(big))
                out[key] = big.raw[:n].decode("utf-8", "replace")
            else:
                out[key] = buf.raw[:n].decode("utf-8", "replace")
        return out
