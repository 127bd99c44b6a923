"""llama.cpp backend over llama-cpp-python's low-level API: one context, one slot per sequence.

Each slot is a llama.cpp sequence id with its own KV stream (`kv_unified = false`), so a request computes
exactly the same numbers whether it runs alone or beside others: temperature 0 is deterministic under load.
With `--kv-unified` the slots share one pool of `num_ctx` cells instead (each may grow to all of it); a batch that
finds no room raises PoolFull and the engine makes room (engine/slots/scheduler.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import mmap
import os
import random
import secrets
import threading
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
from llama_cpp import mtmd_cpp as mtmd

from lmserve.engine import fim
from lmserve.engine.llamacpp import batch_rows, recurrent_state, rerank
from lmserve.engine.llamacpp.cpu_load import ThreadGovernor
from lmserve.engine.llamacpp.draft_model import DraftModel
from lmserve.engine.llamacpp.memory import context_choice
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.logprobs import Ranked, rank_candidates, score_tokens
from lmserve.engine.prompt_logprobs import PromptLogprobs
from lmserve.engine.protocol import FimTokens, ModelInfo, PromptImage
from lmserve.engine.slots.backend import BatchEntry, PoolFull
from lmserve.engine.slots.prompt_disk import SavedState
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import AUTO_CONTEXT, Bitmap, LoadOptions, SamplingParams

LAUNCH_DEFAULTS = LlamaCppLaunch()

log = logging.getLogger(__name__)

_GGML_LOG_LEVEL_ERROR = 4
_backend_lock = threading.Lock()
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
"""llama_token_data as a numpy record: the candidates the sampler chain works on."""
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


class _ImageChunk:
    """An owned mtmd image chunk and its embeddings from the projector; freed when the last reference to it goes."""

    def __init__(self, pointer: Any, embeddings: np.ndarray) -> None:
        self.pointer = pointer
        self.embeddings = embeddings
        """float32 (tokens x the model's input width): what the engine thread decodes into the sequence."""

    def __del__(self) -> None:
        pointer, self.pointer = self.pointer, None
        if pointer:
            with contextlib.suppress(Exception):  # at interpreter exit the bindings may already be gone
                mtmd.mtmd_input_chunk_free(pointer)


def image_id(bitmap: Bitmap) -> bytes:
    """A digest of an image's pixels and size: equal images get equal ids (and equal placeholders)."""
    digest = hashlib.blake2b(bitmap.rgb, digest_size=8, person=b"lmserve-img")
    digest.update(f"{bitmap.width}x{bitmap.height}".encode())
    return digest.hexdigest().encode()


def image_placeholder(chunk_id: bytes) -> int:
    """The negative id that fills the prompt positions of an image chunk with id `chunk_id` (see `image_id`)."""
    return -1 - int(chunk_id[:8] or b"0", 16) % (2**31 - 1)


def _state_buffer(size: int) -> SavedState:
    """A writable buffer of `size` bytes for a saved state: pre-faulted anonymous memory where the platform has
    MAP_POPULATE, else a bytearray."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if not populate or size == 0:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)


def default_threads() -> int:
    """One thread per core this process may run on (its affinity: a container's or `taskset`'s cores, not every core
    of the machine); the machine's count where the platform cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


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


def load_mode(options: LoadOptions) -> int:
    """llama.cpp's load mode for use_mmap (None: its own choice) and use_mlock."""
    if options.use_mlock:
        return lc.LLAMA_LOAD_MODE_MLOCK if options.use_mmap is False else lc.LLAMA_LOAD_MODE_MMAP_MLOCK
    if options.use_mmap is None:
        return lc.LLAMA_LOAD_MODE_AUTO
    return lc.LLAMA_LOAD_MODE_MMAP if options.use_mmap else lc.LLAMA_LOAD_MODE_NONE


GPU_PLACEMENT = frozenset({"num_gpu_layers", "main_gpu"})
"""The load options that place layers on a GPU: inert on a llama.cpp built without GPU offload."""


class LlamaCppBackend:
    """A GGUF model loaded in llama.cpp, decoding up to `num_parallel` sequences per batch."""

    def __init__(self, path: str | Path, options: LoadOptions, launch: LlamaCppLaunch = LAUNCH_DEFAULTS) -> None:
        init_llama_backend()
        check_kv_options(launch)
        path = Path(path)
        if not path.is_file():
            raise EngineFailure(f"model file not found: {path}")
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = options.num_gpu_layers
        mparams.main_gpu = options.main_gpu
        mparams.load_mode = load_mode(options)
        model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise EngineFailure(f"llama.cpp could not load {path.name}: not a valid GGUF model")
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)
        threads = options.num_threads or default_threads()
        # Auto, or what was asked (untrusted from a request) but never more than the model was trained for.
        choice = context_choice(model, path, options, launch)
        is_reranker = rerank.is_reranker(model)
        num_ctx = rerank.context_size(choice.num_ctx, auto=options.num_ctx == AUTO_CONTEXT) if is_reranker \
            else choice.num_ctx
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
        if is_reranker:  # its context ranks pairs and generates nothing (the engine refuses prompts)
            rerank.configure(cparams, num_ctx, bidirectional=rerank.is_bidirectional(model),
                             flash_attn=launch.flash_attn)
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            lc.llama_model_free(model)
            kv = f" with a {launch.cache_type_k}/{launch.cache_type_v} KV cache and flash attention " \
                 f"{launch.flash_attn}" if (launch.cache_type_k, launch.cache_type_v) != ("f16", "f16") else ""
            raise EngineFailure(f"llama.cpp could not create a context of {cparams.n_ctx} tokens for {path.name}{kv}")
        self._ctx = ctx
        self._adapters: list[Any] = []  # llama_adapter_lora pointers (the bindings annotate them as c_void_p)
        try:
            self._load_adapters(options.adapters)
        except EngineFailure:
            self._free_adapters()
            lc.llama_free(ctx)
            lc.llama_model_free(model)
            raise
        self._memory = lc.llama_get_memory(ctx)
        self._batch_capacity = cparams.n_batch if is_reranker else options.num_batch
        self._batch = lc.llama_batch_init(self._batch_capacity, 0, 1)
        self._num_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self._eog = frozenset(t for t in range(self._num_vocab) if lc.llama_vocab_is_eog(self._vocab, t))
        self._samplers: dict[int, lc.llama_sampler_p] = {}
        self._last_rows: dict[int, int] = {}
        """The batch row each slot sampled from in the last step (forks sample from it too)."""
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._logprob_slots: dict[int, int] = {}
        """Slots whose request asked for logprobs → how many alternatives."""
        self._ranked: dict[int, Ranked] = {}
        """The last step's sampled tokens, ranked, of the slots in `_logprob_slots`."""
        self._score_slots: dict[int, list[int]] = {}
        """Slots whose request named `score_tokens` → those tokens."""
        self._prompt_scoring: dict[int, PromptLogprobs] = {}
        """Slots prefilling a prompt whose log-probabilities were asked for: every prompt row keeps its logits."""
        self._prompt_ranked: dict[int, list[Ranked]] = {}
        """Those slots' prompt log-probabilities once the prompt is in (`take_prompt_logprobs`)."""
        self._scores: dict[int, list[float]] = {}
        """The last step's scores of the slots in `_score_slots`."""
        self._drafted: dict[int, list[int]] = {}
        """The last step's samples after the first of each slot whose entry carried a draft (`take_drafted`)."""
        self._copying: set[int] = set()
        """Slots a copy between KV streams reads from or writes to: llama.cpp copies the buffers at the next decode,
        so until then their states must be neither saved (stale) nor restored (overwritten by, or into, the copy)."""
        self._redo: dict[int, tuple[int, list[int]]] = {}
        """Slots of a hybrid model rewound after a rejected draft → (position, the accepted tokens to decode again
        there), decoded before anything else touches the memory (`_redecode`)."""
        self._candidates = np.zeros(self._num_vocab, dtype=_TOKEN_DATA)
        self._vocab_ids = np.arange(self._num_vocab, dtype=np.int32)
        self._num_threads = threads
        self._governor = ThreadGovernor(threads) if launch.thread_policy == "adaptive" else None
        self._step_threads = threads
        self._embed_ctx: lc.llama_context_p | None = None
        self._embed_batch: Any = None  # a llama_batch (untyped in the bindings)
        self._mtmd: Any = None  # an mtmd_context pointer, when the model has a vision projector
        self._mtmd_lock = threading.Lock()
        self._image_marker: str | None = None
        self._draft_model: DraftModel | None = None
        self._rank_format = rerank.pair_format(model, self._vocab) if is_reranker else None
        """How the reranker reads a pair; None: the model is no reranker."""
        try:
            if options.projector:
                self._load_projector(options, launch)
            if launch.model_draft:
                self._load_draft_model(options, launch, num_ctx, threads, path.name)
        except EngineFailure:
            self.close()
            raise
        metadata = self._read_metadata()
        template = lc.llama_model_chat_template(model, None)
        architecture = metadata.get("general.architecture", "")
        self._rank_softmax = architecture in rerank.SOFTMAX_ARCHITECTURES
        self.info = ModelInfo(
            path=str(path),
            architecture=architecture,
            # a reranker's pair is decoded in one micro-batch
            num_ctx=min(lc.llama_n_ctx_seq(ctx), lc.llama_n_ubatch(ctx)) if is_reranker else lc.llama_n_ctx_seq(ctx),
            num_parallel=options.num_parallel,
            num_vocab=self._num_vocab,
            num_ctx_train=choice.trained,
            chat_template=template.decode("utf-8", "replace") if template else None,
            bos_token=self._token_text(lc.llama_vocab_bos(self._vocab)),
            eos_token=self._token_text(lc.llama_vocab_eos(self._vocab)),
            size_bytes=lc.llama_model_size(model),
            num_params=lc.llama_model_n_params(model),
            description=self._model_desc(),
            metadata=metadata,
            image_marker=self._image_marker,
            can_cut_memory=not (lc.llama_model_is_hybrid(model) or lc.llama_model_is_recurrent(model)),
            fim=self._fim_tokens(),
            draft_model=self._draft_model.name if self._draft_model is not None else None,
            num_kv_cells=lc.llama_n_ctx(ctx),
            can_rank=is_reranker,
            can_embed=not is_reranker,
            inert_load_options=frozenset() if lc.llama_supports_gpu_offload() else GPU_PLACEMENT,
        )

    # ---- vocabulary ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tokens = self._tokenize_raw(text, add_special, parse_special)
        bos = lc.llama_vocab_bos(self._vocab)
        if len(tokens) >= 2 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
        return tokens

    def _tokenize_raw(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """llama.cpp's tokens of `text`, as they come (llama-server's `common_tokenize`)."""
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool) -> bytes:
        key = (token, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            n = lc.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
                piece = buf.raw[:n]
            else:
                piece = self._piece_buf.raw[:n]
            self._piece_cache[key] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def tokenize_images(self, text: str, images: list[Bitmap]) -> tuple[list[int], list[PromptImage]]:
        if self._mtmd is None or self._image_marker is None:
            raise InvalidRequest("this model has no vision projector; images are not supported", param="images")
        if text.count(self._image_marker) != len(images):
            raise InvalidRequest("the prompt's image markers do not match its images", param="images")
        data = text.encode("utf-8")
        text_input = mtmd.mtmd_input_text(text=data, text_len=len(data), add_special=True, parse_special=True)
        tokens: list[int] = []
        places: list[PromptImage] = []
        with self._mtmd_lock:
            bitmaps = [self._bitmap(image) for image in images]
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                array = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
                rc = mtmd.mtmd_tokenize(self._mtmd, chunks, ctypes.byref(text_input), array, len(bitmaps))
                if rc != 0:
                    reason = "its image markers do not match its images" if rc == 1 else "an image failed to preprocess"
                    raise InvalidRequest(f"the prompt could not be tokenized: {reason}", param="images")
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                    kind = mtmd.mtmd_input_chunk_get_type(chunk)
                    if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                        count = ctypes.c_size_t(0)
                        pointer = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                        tokens += pointer[: count.value] if count.value else []
                    elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                        length = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                        if mtmd.mtmd_input_chunk_get_n_pos(chunk) != length:
                            raise EngineFailure("image positions differ from image tokens (M-RoPE is not supported)")
                        handle = _ImageChunk(mtmd.mtmd_input_chunk_copy(chunk), self._encode(chunk, length))
                        places.append(PromptImage(len(tokens), length, handle))
                        tokens += [image_placeholder(mtmd.mtmd_input_chunk_get_id(chunk) or b"")] * length
                    else:
                        raise InvalidRequest("only images are supported as media", param="images")
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                for bitmap in bitmaps:
                    mtmd.mtmd_bitmap_free(bitmap)
        bos = lc.llama_vocab_bos(self._vocab)
        if len(tokens) >= 2 and tokens[0] == bos and tokens[1] == bos:  # the template wrote BOS, mtmd added one
            tokens = tokens[1:]
            for place in places:
                place.start -= 1
        return tokens, places

    # ---- slots ----------------------------------------------------------------------------------

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        self._redecode()
        if num_reused <= 0 or not lc.llama_memory_seq_rm(self._memory, slot, num_reused, -1):
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)  # hybrid/recurrent memory cannot be cut
            num_reused = 0
        sampler = self._build_sampler(sampling, prompt)
        for token in generated or ():
            lc.llama_sampler_accept(sampler, token)
        old = self._samplers.pop(slot, None)
        if old is not None:
            lc.llama_sampler_free(old)
        self._samplers[slot] = sampler
        if sampling.logprobs is None:
            self._logprob_slots.pop(slot, None)
        else:
            self._logprob_slots[slot] = sampling.logprobs
        self._scores.pop(slot, None)
        if sampling.score_tokens:
            self._score_slots[slot] = list(sampling.score_tokens)
        else:
            self._score_slots.pop(slot, None)
        self._prompt_ranked.pop(slot, None)
        if sampling.prompt_logprobs is None:
            self._prompt_scoring.pop(slot, None)
        else:
            self._prompt_scoring[slot] = PromptLogprobs(sampling.prompt_logprobs)
        return num_reused

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        """Copy `source`'s memory into `slot`, then cut it to `length` positions.

        With one KV stream per slot llama.cpp copies whole streams (the buffer copy runs at the next decode, before
        that batch is computed); the cut needs memory that can be cut, so hybrid models say no.
        """
        if not self.info.can_cut_memory:
            return False
        self._redecode()
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
        lc.llama_memory_seq_cp(self._memory, source, slot, -1, -1)
        self._copying.update((source, slot))
        if not lc.llama_memory_seq_rm(self._memory, slot, length, -1):
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            return False
        return True

    def fork(self, source: int, slots: list[int]) -> list[int | None]:
        """Copy `source`'s whole memory into each slot and sample each slot's first token from `source`'s last row.

        A whole copy needs no cut, so hybrid and recurrent memory fork too (llama.cpp shares the recurrent state
        cell and copies it on the next write). The row's logits stay valid until the next decode.
        """
        row = self._last_rows.get(source)
        if row is None:
            return [None] * len(slots)
        tokens: list[int | None] = []
        for slot in slots:
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            lc.llama_memory_seq_cp(self._memory, source, slot, -1, -1)
            self._copying.update((source, slot))
            tokens.append(self._sample(slot, row))
        return tokens

    def save_state(self, slot: int) -> SavedState | None:
        """The slot's state, copied once: llama.cpp writes it straight into the buffer returned (tens of MiB for a
        long prompt), an anonymous mapping whose pages the kernel faults in at once (half the time of touching
        them one by one) and gives back when it is dropped; nobody writes to it afterwards."""
        self._redecode()
        if slot in self._copying:
            return None
        size = lc.llama_state_seq_get_size(self._ctx, slot)
        state = _state_buffer(size)
        written = lc.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(state), size, slot)
        return state if written == size else state[:written]

    def restore_state(self, slot: int, state: SavedState, length: int) -> bool:
        if slot in self._copying:
            return False
        self._redo.pop(slot, None)
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
        array = ctypes.c_uint8 * len(state)  # read in place when writable (a saved state), else copied
        buf = array.from_buffer_copy(state) if isinstance(state, bytes) else array.from_buffer(state)
        if lc.llama_state_seq_set_data(self._ctx, buf, len(state), slot) == 0 or \
                not lc.llama_memory_seq_rm(self._memory, slot, length, -1):
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            return False
        return True

    @staticmethod
    def check_grammar(grammar: str) -> None:
        """Raise InvalidRequest unless llama.cpp parses `grammar` (GBNF, root rule `root`).

        The grammar is parsed without the vocabulary: this touches no model state, so any thread may call it.
        """
        sampler = lc.llama_sampler_init_grammar(None, grammar.encode("utf-8"), b"root")
        if not sampler:
            raise InvalidRequest("the output grammar is invalid: llama.cpp could not parse it (see the server log)")
        lc.llama_sampler_free(sampler)

    def clear(self, slot: int) -> None:
        self._redo.pop(slot, None)
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def release(self, slot: int) -> None:
        self._prompt_scoring.pop(slot, None)
        self._prompt_ranked.pop(slot, None)
        self._logprob_slots.pop(slot, None)
        self._score_slots.pop(slot, None)
        self._scores.pop(slot, None)
        sampler = self._samplers.pop(slot, None)
        if sampler is not None:
            lc.llama_sampler_free(sampler)

    def step(self, entries: list[BatchEntry]) -> list[int | None]:
        self._redecode()
        images = [entry for entry in entries if entry.image is not None]
        for i, entry in enumerate(images):
            try:
                self._decode_image(entry)
            except PoolFull:
                self._forget(images[: i + 1])
                raise
        rewinds = {} if self.info.can_cut_memory else \
            {entry.slot: recurrent_state.save(self._ctx, entry.slot) for entry in entries if entry.draft}
        batch = self._batch
        n = 0
        outputs = [-1] * len(entries)
        prompt_rows: dict[int, int] = {}  # entry index → its first batch row, for prompt log-probabilities
        # Tokens go in slot order: with one KV stream per slot, llama.cpp decodes an ordered batch without
        # regrouping it (measured: 8 streams in descending order took 70 ms a step, ascending 36 ms).
        for index in sorted(range(len(entries)), key=lambda i: entries[i].slot):
            entry = entries[index]
            if entry.image is not None:
                continue
            if n + len(entry.tokens) > self._batch_capacity:
                raise EngineFailure("batch overflow")
            scored = entry.slot in self._prompt_scoring and not entry.draft
            if scored:
                prompt_rows[index] = n
            for i, token in enumerate(entry.tokens, start=entry.pos):
                batch.token[n] = token
                batch.pos[n] = i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = entry.slot
                batch.logits[n] = scored
                n += 1
            if entry.wants_sample:
                for row in range(n - 1 - entry.draft, n):  # a drafted entry samples after each of its tokens
                    batch.logits[row] = True
                outputs[index] = n - 1 - entry.draft
        batch.n_tokens = n
        if n == 0:
            return [None] * len(entries)
        if self._governor is not None:
            self._set_threads(self._governor.threads())
        rc = lc.llama_decode(self._ctx, batch)
        if rc == 1:  # no room in the KV pool: llama.cpp placed nothing of the batch (its prepare undoes every cell)
            self._forget(images)
            raise PoolFull(f"no room for a batch of {n} tokens in the KV pool")
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc}")
        self._copying.clear()  # the decode made the pending copies
        self._ranked.clear()
        self._drafted.clear()
        self._last_rows = {entry.slot: output for entry, output in zip(entries, outputs, strict=True) if output >= 0}
        for index, first in prompt_rows.items():
            self._score_prompt(entries[index], first)
        sampled: list[int | None] = []
        for entry, output in zip(entries, outputs, strict=True):
            if output < 0:
                sampled.append(None)
                continue
            token = self._sample(entry.slot, output)
            if entry.draft:
                self._verify(entry, token, output, rewinds.get(entry.slot))
            sampled.append(token)
        return sampled

    def _forget(self, images: list[BatchEntry]) -> None:
        """Drop what image entries of a step that failed for room put in their slots (from each one's position)."""
        for entry in images:
            lc.llama_memory_seq_rm(self._memory, entry.slot, entry.pos, -1)

    def _verify(self, entry: BatchEntry, first: int, output: int, recurrent: bytes | None) -> None:
        """Sample after each drafted token of `entry` while the samples agree with the draft (the first sample,
        `first`, came from row `output`); keep the agreed tokens in the slot's memory and forget the rest: cut
        them off, or for a hybrid model put back the `recurrent` state saved before the step and decode the agreed
        tokens again (engine/llamacpp/recurrent_state.py)."""
        draft = entry.tokens[1:]
        taken: list[int] = []
        token = first
        while len(taken) < len(draft) and token == draft[len(taken)]:
            token = self._sample(entry.slot, output + len(taken) + 1)
            taken.append(token)
        self._drafted[entry.slot] = taken
        self._last_rows[entry.slot] = output + len(taken)
        agreed = entry.pos + 1 + len(taken)  # the pending token, then the drafted tokens the samples agreed with
        if agreed == entry.pos + len(entry.tokens):
            return
        if recurrent is None:
            lc.llama_memory_seq_rm(self._memory, entry.slot, agreed, -1)
        elif recurrent_state.rewind(self._ctx, entry.slot, recurrent, entry.pos):
            self._redo[entry.slot] = entry.pos, entry.tokens[: 1 + len(taken)]
        else:
            raise EngineFailure("llama.cpp could not put back a hybrid sequence's state after a rejected draft")

    def _redecode(self) -> None:
        """Decode again what rewinds after rejected drafts took back (`_redo`), every such slot in one batch. Its
        logits are not needed: the next tokens were sampled in the drafted step."""
        rows = [(slot, pos + i, token, False) for slot, (pos, tokens) in sorted(self._redo.items())
                for i, token in enumerate(tokens)]
        for start in range(0, len(rows), self._batch_capacity):
            batch_rows.fill(self._batch, rows[start:start + self._batch_capacity])
            rc = lc.llama_decode(self._ctx, self._batch)
            if rc == 1 and start == 0:  # nothing of it placed: the engine makes room and steps again
                raise PoolFull(f"no room to decode {len(rows)} rewound tokens again in the KV pool")
            if rc != 0:
                raise EngineFailure(f"llama_decode failed with code {rc} decoding rewound tokens again")
        self._redo.clear()

    def take_drafted(self, slot: int) -> list[int]:
        return self._drafted.pop(slot, [])

    def draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        if self._draft_model is None:
            return {}
        if self._governor is not None:
            self._set_threads(self._governor.threads())
        return self._draft_model.draft(requests)

    def _set_threads(self, threads: int) -> None:
        """Compute the next steps with `threads` threads (ThreadGovernor's choice), the draft model's too."""
        if threads != self._step_threads:
            lc.llama_set_n_threads(self._ctx, threads, threads)
            self._step_threads = threads
        if self._draft_model is not None:
            self._draft_model.set_threads(threads)

    @property
    def step_threads(self) -> int:
        """The threads the last step computed with."""
        return self._step_threads

    def _sample(self, slot: int, output: int) -> int:
        """Sample the slot's next token from batch row `output`; a slot that asked for logprobs gets them ranked."""
        scored = self._score_slots.get(slot)
        if scored is not None:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, output), shape=(self._num_vocab,))
            self._scores[slot] = score_tokens(logits, scored)
        k = self._logprob_slots.get(slot)
        if k is None:
            return int(lc.llama_sampler_sample(self._samplers[slot], self._ctx, output))
        ranked = self._sample_ranked(self._samplers[slot], output, k)
        self._ranked[slot] = ranked
        return ranked[0]

    def _sample_ranked(self, sampler: lc.llama_sampler_p, output: int, k: int) -> Ranked:
        """What `llama_sampler_sample` does (the chain applied to the row's logits, the pick accepted), keeping the
        candidates the chain leaves for their log-probabilities (engine/logprobs.py says which distribution)."""
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, output), shape=(self._num_vocab,))
        cells = self._candidates
        cells["id"] = self._vocab_ids
        cells["logit"] = logits
        cells["p"] = 0.0
        array = lc.llama_token_data_array(
            data=cells.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=self._num_vocab, selected=-1,
            sorted=False,
        )
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        size, selected = int(array.size), int(array.selected)
        if not 0 <= selected < size:
            raise EngineFailure("the sampler selected no token")
        # the chain may leave its candidates in a buffer of its own: read them where `data` points now
        kept = np.ctypeslib.as_array(array.data, shape=(size,)) if size else cells[:0]
        ranked = rank_candidates(kept["id"], kept["logit"], selected, k)
        lc.llama_sampler_accept(sampler, ranked[0])
        return ranked

    def _score_prompt(self, entry: BatchEntry, first: int) -> None:
        """Rank the prompt tokens of `entry` by the logits of the rows from `first` (engine/prompt_logprobs.py)."""
        scoring = self._prompt_scoring[entry.slot]
        rows = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, first + i),
                                               shape=(self._num_vocab,)) for i in range(len(entry.tokens))])
        scoring.add(rows, entry.tokens, last=entry.wants_sample)
        if entry.wants_sample:
            self._prompt_ranked[entry.slot] = scoring.take()
            del self._prompt_scoring[entry.slot]

    def take_prompt_logprobs(self, slot: int) -> list[Ranked] | None:
        """The ranked log-probability of each prompt token after the first, once the prompt is in (None: not asked
        for, or given already)."""
        return self._prompt_ranked.pop(slot, None)

    def take_logprobs(self, slot: int) -> Ranked | None:
        """The ranked log-probabilities of the token the last `step` sampled for `slot` (None: it asked for none)."""
        return self._ranked.get(slot)

    def take_scores(self, slot: int) -> list[float] | None:
        return self._scores.pop(slot, None)

    def _encode(self, chunk: Any, length: int) -> np.ndarray:
        """Run the projector on an image chunk (under the mtmd lock) and copy out its embeddings.

        This runs where the prompt is tokenized, in a worker thread, so the engine thread keeps decoding other
        sequences meanwhile; the engine thread only decodes the embeddings (`_decode_image`).
        """
        rc = mtmd.mtmd_encode_chunk(self._mtmd, chunk)
        if rc != 0:
            raise EngineFailure(f"the vision projector failed to encode an image (code {rc})")
        width = lc.llama_model_n_embd_inp(self._model)
        output = mtmd.mtmd_get_output_embd(self._mtmd)
        if not output:
            raise EngineFailure("the vision projector returned no embeddings")
        return np.ctypeslib.as_array(output, shape=(length * width,)).copy()

    def _decode_image(self, entry: BatchEntry) -> None:
        """Decode an encoded image's embeddings into the slot's memory at the entry's position."""
        assert entry.image is not None
        chunk = entry.image.handle
        if not isinstance(chunk, _ImageChunk) or not chunk.pointer:
            raise EngineFailure("an image of another model was submitted")
        new_pos = lc.llama_pos(0)
        embeddings = chunk.embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        rc = mtmd.mtmd_helper_decode_image_chunk(
            self._mtmd, self._ctx, chunk.pointer, embeddings, entry.pos, entry.slot, self._batch_capacity,
            ctypes.byref(new_pos), mtmd.mtmd_helper_post_decode_callback(), None,
        )
        if rc == 1:
            raise PoolFull(f"no room for an image of {entry.num_positions} positions in the KV pool")
        if rc != 0:
            raise EngineFailure(f"decoding an image failed with code {rc}")

    # ---- embeddings ---------------------------------------------------------------------------

    def embed(self, tokens: list[int]) -> list[float]:
        """Mean of the final hidden states over `tokens`, decoded in a context of its own.

        The embedding context is created on first use (one sequence of `num_ctx` tokens) and never touches
        the slots. It pools nothing itself: the text is decoded `num_batch` tokens at a time and the
        per-token states are summed here, so a long text needs no batch as large as the context (mean
        pooling in llama.cpp needs the whole sequence in one micro-batch).
        """
        if not tokens:
            raise EngineFailure("cannot embed an empty token list")
        if len(tokens) > self.info.num_ctx:
            raise EngineFailure(f"cannot embed {len(tokens)} tokens in a context of {self.info.num_ctx}")
        ctx, batch = self._embedding_context()
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        num_embd = lc.llama_model_n_embd(self._model)
        total = np.zeros(num_embd, dtype=np.float64)
        for start in range(0, len(tokens), self._batch_capacity):
            chunk = tokens[start : start + self._batch_capacity]
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
            batch.n_tokens = len(chunk)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise EngineFailure(f"llama_decode failed with code {rc} while embedding")
            states = lc.llama_get_embeddings(ctx)
            if not states:
                raise EngineFailure("llama.cpp returned no embeddings")
            total += np.ctypeslib.as_array(states, shape=(len(chunk), num_embd)).sum(axis=0, dtype=np.float64)
        return [float(x) for x in total / len(tokens)]

    def _embedding_context(self) -> tuple[lc.llama_context_p, Any]:
        if self._embed_ctx is not None and self._embed_batch is not None:
            return self._embed_ctx, self._embed_batch
        cparams = lc.llama_context_default_params()
        cparams.n_seq_max = 1
        cparams.n_ctx = self.info.num_ctx
        cparams.n_batch = self._batch_capacity
        cparams.n_ubatch = self._batch_capacity
        cparams.n_threads = self._num_threads
        cparams.n_threads_batch = self._num_threads
        cparams.embeddings = True
        cparams.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise EngineFailure(f"llama.cpp could not create an embedding context of {cparams.n_ctx} tokens")
        try:
            self._apply_adapters(ctx)
        except EngineFailure:
            lc.llama_free(ctx)
            raise
        self._embed_ctx = ctx
        self._embed_batch = lc.llama_batch_init(self._batch_capacity, 0, 1)
        return ctx, self._embed_batch

    # ---- reranking ----------------------------------------------------------------------------

    def rank_tokens(self, query: str, document: str, limit: int | None) -> list[int]:
        """The (query, document) pair as this reranker reads it, as llama-server forms it (engine/llamacpp/rerank.py);
        its document cut so the pair holds at most `limit` tokens where it can (None: never cut). Any thread."""
        if self._rank_format is None:
            raise InvalidRequest("this model is not a dedicated reranker", param="model")
        return rerank.pair_tokens(self._rank_format, self._tokenize_raw, query, document, limit)

    def rank(self, pairs: list[list[int]]) -> list[float]:
        """Each pair's relevance logit from the reranker's head (see `rerank.score`), computed in the model's context
        (a reranker's: it holds no slots' sequences). Pairs are decoded together, in order, as many at a time as the
        context's sequences and micro-batch take."""
        if self._rank_format is None:
            raise InvalidRequest("this model is not a dedicated reranker", param="model")
        capacity = min(self._batch_capacity, lc.llama_n_ubatch(self._ctx))
        for pair in pairs:
            if not pair or len(pair) > capacity:  # llama.cpp would abort on a bidirectional pair beyond its micro-batch
                raise EngineFailure(f"cannot rank a pair of {len(pair)} tokens in a micro-batch of {capacity}")
        scores = [0.0] * len(pairs)
        for group in rerank.groups([len(pair) for pair in pairs], capacity, lc.llama_n_seq_max(self._ctx)):
            for i, value in zip(group, self._rank_group([pairs[i] for i in group]), strict=True):
                scores[i] = value
        return scores

    def _rank_group(self, pairs: list[list[int]]) -> list[float]:
        """Decode `pairs` in one batch, one sequence each, and read each one's pooled head output."""
        if self._memory:  # a causal reranker's KV cache; a bidirectional one has none
            lc.llama_memory_clear(self._memory, True)
        batch_rows.fill(self._batch, [(seq, pos, token, True) for seq, pair in enumerate(pairs)
                                      for pos, token in enumerate(pair)])
        rc = lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc} while ranking")
        num_values = lc.llama_model_n_cls_out(self._model)
        scores = []
        for seq in range(len(pairs)):
            values = lc.llama_get_embeddings_seq(self._ctx, seq)
            if not values:
                raise EngineFailure("llama.cpp returned no rank score")
            scores.append(rerank.score(values[:num_values], self._rank_softmax))
        return scores

    def close(self) -> None:
        if self._draft_model is not None:
            self._draft_model.close()
            self._draft_model = None
        if self._mtmd is not None:
            mtmd.mtmd_free(self._mtmd)
            self._mtmd = None
        for sampler in self._samplers.values():
            lc.llama_sampler_free(sampler)
        self._samplers.clear()
        if self._embed_ctx is not None:
            if self._embed_batch is not None:
                lc.llama_batch_free(self._embed_batch)
                self._embed_batch = None
            lc.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if self._ctx:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None
        self._free_adapters()  # after every context using them, before the model
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    # ---- helpers --------------------------------------------------------------------------------

    def _load_projector(self, options: LoadOptions, launch: LlamaCppLaunch) -> None:
        """Load the vision projector with a marker of our own, so no user text can pose as an image."""
        assert options.projector is not None
        if not Path(options.projector).is_file():
            raise EngineFailure(f"vision projector file not found: {options.projector}")
        marker = f"<__lmserve_image_{secrets.token_hex(6)}__>"
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = options.num_gpu_layers != 0
        params.n_threads = self._num_threads
        params.print_timings = False
        params.media_marker = marker.encode()
        if launch.image_min_tokens > 0:
            params.image_min_tokens = launch.image_min_tokens
        if launch.image_max_tokens > 0:
            params.image_max_tokens = launch.image_max_tokens
        context = mtmd.mtmd_init_from_file(os.fsencode(options.projector), self._model, params)
        if not context:
            raise EngineFailure(
                f"llama.cpp could not load the vision projector {Path(options.projector).name}: not an mmproj GGUF "
                "for this model"
            )
        self._mtmd = context
        if not mtmd.mtmd_support_vision(context):
            raise EngineFailure(f"the projector {Path(options.projector).name} does not take images")
        if mtmd.mtmd_decode_use_mrope(context):
            raise EngineFailure("vision models with M-RoPE positions (Qwen2-VL and kin) are not supported yet")
        self._image_marker = marker

    def _load_draft_model(self, options: LoadOptions, launch: LlamaCppLaunch, num_ctx: int, threads: int,
                          name: str) -> None:
        """Load `launch.model_draft` to draft for this model (EngineFailure unless they share the vocabulary)."""
        assert launch.model_draft is not None
        draft = DraftModel(launch.model_draft, num_slots=options.num_parallel, num_ctx=num_ctx,
                           num_batch=options.num_batch, threads=threads, num_gpu_layers=options.num_gpu_layers,
                           p_min=launch.draft_p_min)
        try:
            draft.pair(self._vocab, name)
        except EngineFailure:
            draft.close()
            raise
        self._draft_model = draft

    @staticmethod
    def _bitmap(image: Bitmap) -> Any:
        """An mtmd bitmap of the image, its id set to the image's digest (tile chunks carry it on)."""
        if len(image.rgb) != image.width * image.height * 3 or image.width < 1 or image.height < 1:
            raise InvalidRequest("an image's pixel data does not match its size", param="images")
        pixels = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
        if not bitmap:
            raise EngineFailure("llama.cpp could not take an image")
        mtmd.mtmd_bitmap_set_id(bitmap, image_id(image))
        return bitmap

    def _load_adapters(self, paths: tuple[str, ...]) -> None:
        """Load each LoRA adapter GGUF for the model and apply them all to the context at scale 1.0."""
        for adapter_path in paths:
            if not Path(adapter_path).is_file():
                raise EngineFailure(f"LoRA adapter file not found: {adapter_path}")
            adapter = lc.llama_adapter_lora_init(self._model, os.fsencode(adapter_path))
            if not adapter:
                raise EngineFailure(
                    f"llama.cpp could not load the LoRA adapter {Path(adapter_path).name}: not a LoRA GGUF "
                    "for this model"
                )
            self._adapters.append(adapter)
        self._apply_adapters(self._ctx)

    def _apply_adapters(self, ctx: lc.llama_context_p) -> None:
        if not self._adapters:
            return
        count = len(self._adapters)
        adapters = (lc.llama_adapter_lora_p_ctypes * count)(*self._adapters)
        scales = (ctypes.c_float * count)(*([1.0] * count))
        rc = lc.llama_set_adapters_lora(ctx, adapters, count, scales)
        if rc != 0:
            raise EngineFailure(f"llama.cpp could not apply {count} LoRA adapter(s): code {rc}")

    def _free_adapters(self) -> None:
        for adapter in self._adapters:
            lc.llama_adapter_lora_free(adapter)
        self._adapters.clear()

    def _build_sampler(self, s: SamplingParams, prompt: list[int]) -> lc.llama_sampler_p:
        """The slot's chain: logit bias, penalties (primed with the prompt), grammar, then the filters and the pick.

        Only the penalty sampler sees the prompt: a grammar accepts nothing but generated tokens. With a grammar,
        an end-of-generation token is allowed exactly when the grammar is complete, so generation ends there.
        """
        params = lc.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = lc.llama_sampler_chain_init(params)
        bias = dict(s.logit_bias)
        if s.ignore_eos:
            bias.update({token: float("-inf") for token in self._eog})
        if bias:
            array = (lc.llama_logit_bias * len(bias))()
            for i, (token, value) in enumerate(bias.items()):
                array[i].token = token  # type: ignore[assignment]
                array[i].bias = value
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(self._num_vocab, len(bias), array))
        if s.repeat_last_n != 0 and (s.repeat_penalty != 1.0 or s.presence_penalty or s.frequency_penalty):
            last_n = self.info.num_ctx if s.repeat_last_n < 0 else min(s.repeat_last_n, self.info.num_ctx)
            penalties = lc.llama_sampler_init_penalties(
                self._num_vocab, last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
            )
            for token in prompt if s.repeat_last_n < 0 else prompt[-s.repeat_last_n :]:
                if token >= 0:  # image placeholders are no tokens
                    lc.llama_sampler_accept(penalties, token)
            lc.llama_sampler_chain_add(chain, penalties)
        if s.grammar is not None:
            grammar = lc.llama_sampler_init_grammar(self._vocab, s.grammar.encode("utf-8"), b"root")
            if not grammar:
                lc.llama_sampler_free(chain)
                raise EngineFailure("llama.cpp could not parse the output grammar")
            lc.llama_sampler_chain_add(chain, grammar)
        self._add_pick(chain, s)
        return chain  # type: ignore[no-any-return]

    def _add_pick(self, chain: lc.llama_sampler_p, s: SamplingParams) -> None:
        """The end of the chain: greedy, Mirostat, or the filters, the temperature and a seeded draw."""
        if s.is_greedy:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return
        seed = (s.seed if s.seed is not None else random.getrandbits(32)) & 0xFFFFFFFF
        if s.mirostat:  # Mirostat picks the token itself, in place of the filters and the distribution
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
            mirostat = (lc.llama_sampler_init_mirostat(self._num_vocab, seed, s.mirostat_tau, s.mirostat_eta, 100)
                        if s.mirostat == 1 else lc.llama_sampler_init_mirostat_v2(seed, s.mirostat_tau, s.mirostat_eta))
            lc.llama_sampler_chain_add(chain, mirostat)
            return
        if s.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
        if s.typical_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_typical(s.typical_p, 1))
        if s.top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = lc.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", "replace") if text else ""

    def _fim_tokens(self) -> FimTokens | None:
        """The FIM tokens llama.cpp found (GGUF `tokenizer.ggml.fim_*_token_id`, the older prefix/suffix/middle keys,
        or known token texts)."""
        v = self._vocab
        return fim.from_ids(lc.llama_vocab_fim_pre(v), lc.llama_vocab_fim_suf(v), lc.llama_vocab_fim_mid(v),
                            lc.llama_vocab_fim_rep(v), lc.llama_vocab_fim_sep(v))

    def _model_desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_desc(self._model, buf, len(buf))
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def _read_metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(1024)
        for i in range(lc.llama_model_meta_count(self._model)):
            n = lc.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            if n < 0:
                continue
            key = buf.raw[: min(n, len(buf) - 1)].decode("utf-8", "replace")
            n = lc.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            if n < 0:
                continue
            if n >= len(buf):
                big = ctypes.create_string_buffer(n + 1)
                lc.llama_model_meta_val_str_by_index(self._model, i, big, len(big))
                out[key] = big.raw[:n].decode("utf-8", "replace")
            else:
                out[key] = buf.raw[:n].decode("utf-8", "replace")
        return out
