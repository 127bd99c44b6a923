"""A llama.cpp model's projector (mtmd): prompts with images and audio clips tokenized, each encoded and decoded into
a slot.

The projector (a vision encoder, an audio encoder, or both) is loaded with a media marker of our own, so no user
text can pose as an image or a clip. Media are encoded where the prompt is tokenized (a worker thread, under the
projector's lock); the engine thread only decodes the embeddings into a slot's memory (`Vision.decode`). Each
image's or clip's prompt positions hold a negative placeholder id derived from its pixels or samples, so equal
media make equal prompts (and share cached prefixes).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
from llama_cpp import mtmd_cpp as mtmd

from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.protocol import PromptImage
from lmserve.engine.slots.backend import BatchEntry, PoolFull
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import Bitmap, Clip, Media

ENCODED_BYTES = 128 * 2**20
"""The projector outputs kept for images and clips sent again (`Encoded`)."""
WHISPER_RATE, WHISPER_WINDOW, WHISPER_HOP, WHISPER_FRAMES = 16_000, 480_000, 160, 3000
"""llama.cpp's Whisper preprocessor: 30 s windows of 3,000 mel frames, 160 samples apart, at 16 kHz."""


class ImageChunk:
    """An owned mtmd image or audio chunk and its embeddings from the projector; freed with the last reference."""

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


def clip_id(clip: Clip) -> bytes:
    """A digest of a clip's samples and rate: equal clips get equal ids (and equal placeholders)."""
    digest = hashlib.blake2b(clip.samples, digest_size=8, person=b"lmserve-aud")
    digest.update(f"{clip.rate}".encode())
    return digest.hexdigest().encode()


def _bitmap(item: Media) -> Any:
    """An mtmd bitmap of an image or a clip, its id set to the item's digest (its chunks carry it on)."""
    if isinstance(item, Clip):
        return _audio_bitmap(item)
    image = item
    if len(image.rgb) != image.width * image.height * 3 or image.width < 1 or image.height < 1:
        raise InvalidRequest("an image's pixel data does not match its size", param="images")
    pixels = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
    bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
    if not bitmap:
        raise EngineFailure("llama.cpp could not take an image")
    mtmd.mtmd_bitmap_set_id(bitmap, image_id(image))
    return bitmap


def _audio_bitmap(clip: Clip) -> Any:
    count = len(clip.samples) // 4
    if count < 1:
        raise InvalidRequest("an audio clip has no samples", param="messages")
    samples = (ctypes.c_float * count).from_buffer_copy(clip.samples)
    bitmap = mtmd.mtmd_bitmap_init_from_audio(count, samples)
    if not bitmap:
        raise EngineFailure("llama.cpp could not take an audio clip")
    mtmd.mtmd_bitmap_set_id(bitmap, clip_id(clip))
    return bitmap


def padding_window(samples: int, windows: int) -> bool:
    """Whether the last of a clip's `windows` audio chunks holds nothing but padding.

    llama.cpp's Whisper preprocessor (Qwen2-Audio, Ultravox, Voxtral, GLM-A) pads every clip with 30 s of silence
    and cuts the spectrogram into whole 30 s windows. A clip of a whole number of windows (give or take a frame:
    from 160 samples under to 40 over) thus gets one window more, all padding, whose samples the window before
    already reaches: a 30 s clip costs two encodings, where Whisper and the models built on its encoder take one.
    Other preprocessors cut clips otherwise; their counts differ from this one's and the rule leaves them alone."""
    expected = ((samples + WHISPER_WINDOW) // WHISPER_HOP + 1) // WHISPER_FRAMES
    return windows >= 2 and windows == expected and samples <= WHISPER_WINDOW * (windows - 1) + 40


class Encoded:
    """The projector's latest outputs, kept by chunk (the image's or clip's digest, the chunk's place among that
    item's chunks, its length) up to a byte budget, least recently used first out: a conversation about an image or
    clip sends it again each turn, and encoding it (a 30 s clip, a large image) costs more than the rest of a turn."""

    def __init__(self, max_bytes: int = ENCODED_BYTES) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[tuple[bytes, int, int], np.ndarray] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[bytes, int, int]) -> np.ndarray | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: tuple[bytes, int, int], embeddings: np.ndarray) -> None:
        if embeddings.nbytes > self._max_bytes or key in self._entries:
            return
        self._entries[key] = embeddings
        self._bytes += embeddings.nbytes
        while self._bytes > self._max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes


class Vision:
    """The projector of a loaded model (images, audio or both), and the marker that stands for an image or a clip in
    its prompts."""

    def __init__(self, projector: str, model: lc.llama_model_p, *, use_gpu: bool, threads: int,
                 launch: LlamaCppLaunch) -> None:
        """Load the vision projector with a marker of our own, so no user text can pose as an image."""
        if not Path(projector).is_file():
            raise EngineFailure(f"vision projector file not found: {projector}")
        marker = f"<__lmserve_image_{secrets.token_hex(6)}__>"
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = threads
        params.print_timings = False
        params.media_marker = marker.encode()
        if launch.image_min_tokens > 0:
            params.image_min_tokens = launch.image_min_tokens
        if launch.image_max_tokens > 0:
            params.image_max_tokens = launch.image_max_tokens
        context = mtmd.mtmd_init_from_file(os.fsencode(projector), model, params)
        if not context:
            raise EngineFailure(
                f"llama.cpp could not load the vision projector {Path(projector).name}: not an mmproj GGUF "
                "for this model"
            )
        self._mtmd: Any = context  # an mtmd_context pointer
        self._model = model
        self._lock = threading.Lock()
        self.sees_images = bool(mtmd.mtmd_support_vision(context))
        self.audio_rate = int(mtmd.mtmd_get_audio_sample_rate(context)) if mtmd.mtmd_support_audio(context) else 0
        """The rate clips are given at (Hz); 0: the projector has no audio encoder."""
        if not self.sees_images and self.audio_rate <= 0:
            self.close()
            raise EngineFailure(f"the projector {Path(projector).name} takes neither images nor audio")
        if mtmd.mtmd_decode_use_mrope(context):
            self.close()
            raise EngineFailure("vision models with M-RoPE positions (Qwen2-VL and kin) are not supported yet")
        self.marker = marker
        self._encoded = Encoded()  # used under the projector's lock

    def tokenize(self, text: str, media: list[Media], bos: int) -> tuple[list[int], list[PromptImage]]:
        """`text`'s tokens with each marker's image or clip encoded in its place (placeholder ids), and their
        places; a doubled `bos` at the start (the template wrote one, mtmd added another) is dropped."""
        if text.count(self.marker) != len(media):
            raise InvalidRequest("the prompt's media markers do not match its images and clips", param="images")
        if any(isinstance(item, Bitmap) for item in media) and not self.sees_images:
            raise InvalidRequest("this model's projector takes audio only; images are not supported", param="images")
        if any(isinstance(item, Clip) for item in media) and self.audio_rate <= 0:
            raise InvalidRequest("this model's projector takes images only; audio is not supported", param="messages")
        data = text.encode("utf-8")
        text_input = mtmd.mtmd_input_text(text=data, text_len=len(data), add_special=True, parse_special=True)
        # Preprocessing (an image resized, a clip's mel spectrogram) runs outside the lock, several prompts at once
        # (as llama-server's request threads do); encoding, which uses the projector's graph, runs under it.
        bitmaps = [_bitmap(item) for item in media]
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            array = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self._mtmd, chunks, ctypes.byref(text_input), array, len(bitmaps))
            if rc != 0:
                reason = ("its media markers do not match its media" if rc == 1
                          else "an image or clip failed to preprocess")
                raise InvalidRequest(f"the prompt could not be tokenized: {reason}", param="images")
            lengths = {clip_id(item): len(item.samples) // 4 for item in media if isinstance(item, Clip)}
            with self._lock:
                tokens, places = self._read_chunks(chunks, self._padding(chunks, lengths))
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
        if len(tokens) >= 2 and tokens[0] == bos and tokens[1] == bos:  # the template wrote BOS, mtmd added one
            tokens = tokens[1:]
            for place in places:
                place.start -= 1
        return tokens, places

    def _padding(self, chunks: Any, lengths: dict[bytes, int]) -> set[tuple[bytes, int]]:
        """The audio chunks (clip id, place among the clip's chunks) that are only the preprocessor's padding
        (`padding_window`), for clips of `lengths` samples at Whisper's rate."""
        if self.audio_rate != WHISPER_RATE:
            return set()
        windows: dict[bytes, int] = {}
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                chunk_id = mtmd.mtmd_input_chunk_get_id(chunk) or b""
                windows[chunk_id] = windows.get(chunk_id, 0) + 1
        return {(chunk_id, count - 1) for chunk_id, count in windows.items()
                if chunk_id in lengths and padding_window(lengths[chunk_id], count)}

    def _read_chunks(self, chunks: Any, padding: set[tuple[bytes, int]]) -> tuple[list[int], list[PromptImage]]:
        """The tokens of tokenized `chunks` (text tokens, and placeholders where images go) and the images' places,
        each image encoded; `padding` chunks left out."""
        tokens: list[int] = []
        places: list[PromptImage] = []
        seen: dict[bytes, int] = {}  # an item's chunks so far (a tiled image, a clip over 30 s have several)
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t(0)
                pointer = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                tokens += pointer[: count.value] if count.value else []
            elif kind in (mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE, mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO):
                length = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                if mtmd.mtmd_input_chunk_get_n_pos(chunk) != length:
                    raise EngineFailure("media positions differ from media tokens (M-RoPE is not supported)")
                chunk_id = mtmd.mtmd_input_chunk_get_id(chunk) or b""
                key = (chunk_id, seen.get(chunk_id, 0), length)
                seen[chunk_id] = key[1] + 1
                if key[:2] in padding:
                    continue
                embeddings = self._encoded.get(key) if chunk_id else None
                if embeddings is None:
                    embeddings = self._encode(chunk, length)
                    if chunk_id:
                        self._encoded.put(key, embeddings)
                handle = ImageChunk(mtmd.mtmd_input_chunk_copy(chunk), embeddings)
                places.append(PromptImage(len(tokens), length, handle))
                tokens += [image_placeholder(chunk_id)] * length
            else:
                raise InvalidRequest("only images and audio are supported as media", param="images")
        return tokens, places

    def _encode(self, chunk: Any, length: int) -> np.ndarray:
        """Run the projector on an image or audio chunk (under the projector's lock) and copy out its embeddings.

        This runs where the prompt is tokenized, in a worker thread, so the engine thread keeps decoding other
        sequences meanwhile; the engine thread only decodes the embeddings (`decode`).
        """
        rc = mtmd.mtmd_encode_chunk(self._mtmd, chunk)
        if rc != 0:
            raise EngineFailure(f"the projector failed to encode an image or clip (code {rc})")
        width = lc.llama_model_n_embd_inp(self._model)
        output = mtmd.mtmd_get_output_embd(self._mtmd)
        if not output:
            raise EngineFailure("the projector returned no embeddings")
        return np.ctypeslib.as_array(output, shape=(length * width,)).copy()

    def decode(self, ctx: lc.llama_context_p, entry: BatchEntry, batch_capacity: int) -> None:
        """Decode an encoded image's or clip's embeddings into the slot's memory at the entry's position."""
        assert entry.image is not None
        chunk = entry.image.handle
        if not isinstance(chunk, ImageChunk) or not chunk.pointer:
            raise EngineFailure("an image of another model was submitted")
        new_pos = lc.llama_pos(0)
        embeddings = chunk.embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        rc = mtmd.mtmd_helper_decode_image_chunk(
            self._mtmd, ctx, chunk.pointer, embeddings, entry.pos, entry.slot, batch_capacity,
            ctypes.byref(new_pos), mtmd.mtmd_helper_post_decode_callback(), None,
        )
        if rc == 1:
            raise PoolFull(f"no room for media of {entry.num_positions} positions in the KV pool")
        if rc != 0:
            raise EngineFailure(f"decoding an image or clip failed with code {rc}")

    def close(self) -> None:
        if self._mtmd is not None:
            mtmd.mtmd_free(self._mtmd)
            self._mtmd = None
