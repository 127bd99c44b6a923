"""Audio clips in requests: OpenAI's `input_audio` (base64 and a format), vLLM's `audio_url` (a data: URI or an http(s)
URL, fetched as images are), uploaded files (the transcription routes) and native `images` entries that are audio
files; checked and decoded by libsndfile (`soundfile`), mixed down to mono and resampled to the model's rate by soxr.

Formats: WAV, FLAC, OGG (Vorbis, Opus) and MP3. A clip is checked where it arrives (a whole file of one of those
formats, within the byte and duration limits of `MediaPolicy`) and decoded where the prompt is tokenized, at the
rate the model's audio encoder takes. Every refusal is an `InvalidRequest` (HTTP 400) whose message says why.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass

import numpy as np
import soundfile
import soxr

from lmserve.chat.media import MediaPolicy, fetch
from lmserve.errors import InvalidRequest
from lmserve.types import Clip

PARAM = "input_audio"
FORMATS = {"WAV": "wav", "WAVEX": "wav", "RF64": "wav", "FLAC": "flac", "OGG": "ogg", "MP3": "mp3"}
"""libsndfile's container names → the format names clients use (OpenAI's `input_audio.format`)."""
FORMAT_NAMES = ("wav", "flac", "ogg", "mp3")
ALIASES = {"wave": "wav", "x-wav": "wav", "mpeg": "mp3", "mpga": "mp3", "opus": "ogg", "oga": "ogg", "x-flac": "flac"}
"""Other names clients give those formats (MIME subtypes, file extensions)."""


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """A checked clip: its format (one of FORMAT_NAMES), length, rate and channels as the file says."""

    format: str
    seconds: float
    rate: int
    channels: int


def _refuse(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def format_name(name: str, param: str = PARAM) -> str:
    """A client's name for an audio format (`wav`, `audio/mpeg`, `.flac`…) as one of FORMAT_NAMES; 400 otherwise."""
    key = name.strip().lower().removeprefix("audio/").removeprefix(".")
    key = ALIASES.get(key, key)
    if key not in FORMAT_NAMES:
        raise _refuse(f"audio format {name!r} is not supported (supported: {', '.join(FORMAT_NAMES)})", param)
    return key


def is_audio(data: bytes) -> bool:
    """Whether `data` begins as an audio file of a supported format (WAV, FLAC, OGG, MP3) rather than an image."""
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return True
    if head[:4] in (b"fLaC", b"OggS", b"RF64") or head[:3] == b"ID3":
        return True
    return len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0  # an MPEG audio frame's sync word


def check_audio(data: bytes, policy: MediaPolicy, param: str = PARAM) -> AudioInfo:
    """Check that `data` is a whole clip of a supported format within the byte and duration limits."""
    if len(data) > policy.max_bytes:
        raise _refuse(f"audio clip is too large: {len(data)} bytes, the limit is {policy.max_bytes}", param)
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as e:  # libsndfile's error for anything it cannot open (soundfile.LibsndfileError, TypeError)
        raise _refuse(f"not a readable audio file ({', '.join(FORMAT_NAMES)}): {_reason(e)}", param) from None
    kind = FORMATS.get(info.format)
    if kind is None:
        raise _refuse(f"audio format {info.format} is not supported (supported: {', '.join(FORMAT_NAMES)})", param)
    if info.frames <= 0 or info.samplerate <= 0:
        raise _refuse("the audio clip is empty", param)
    seconds = info.frames / info.samplerate
    if seconds > policy.max_audio_seconds:
        raise _refuse(f"audio clip is too long: {seconds:.1f} s, the limit is {policy.max_audio_seconds:g} s "
                      "(--audio-max-seconds)", param)
    return AudioInfo(kind, seconds, int(info.samplerate), int(info.channels))


def _payload(text: str) -> str:
    """The base64 of `text`, whitespace and any data: URI prefix dropped."""
    text = "".join(text.split())
    return text.partition(",")[2] if text[:5].lower() == "data:" else text


def is_audio_base64(text: str) -> bool:
    """Whether base64 `text` (or a data: URI) holds an audio file (see `is_audio`), from its first bytes."""
    try:
        return is_audio(base64.b64decode(_payload(text[:200])[:16]))
    except (binascii.Error, ValueError):
        return False


def decode_base64(text: str, declared: str | None, policy: MediaPolicy, param: str = PARAM) -> bytes:
    """Base64 audio (OpenAI's `input_audio.data`, a native `images` entry) as a checked clip's bytes. The file's own
    header decides how it is read; `declared` (`input_audio.format`), when given, must name a supported format."""
    if declared is not None:
        format_name(declared, param)
    text = _payload(text)
    if len(text) // 4 * 3 > policy.max_bytes:
        raise _refuse(f"audio clip is too large: about {len(text) // 4 * 3} bytes, the limit is {policy.max_bytes}",
                      param)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _refuse(f"audio data is not valid base64: {e}", param) from None
    check_audio(data, policy, param)
    return data


async def load_url(url: str, policy: MediaPolicy, param: str = "audio_url") -> bytes:
    """A clip given by URL (vLLM's `audio_url` part) as checked bytes: a data: URI decoded, an http(s) URL fetched
    under the same SSRF guard and limits as images (chat/media.py); other schemes refused."""
    if url[:5].lower() == "data:":
        mime = url[5:].partition(",")[0].partition(";")[0].strip().lower()
        if mime and not mime.startswith("audio/") and mime not in ("application/ogg", "application/octet-stream"):
            raise _refuse(f"data URI media type {mime!r} is not audio", param)
        return decode_base64(url, None, policy, param)
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        data = await fetch(url, policy, "audio")
        check_audio(data, policy, param)
        return data
    raise _refuse("an audio clip must be an http(s) URL or a data: URI (other schemes are refused)", param)


def to_clip(data: bytes, rate: int, param: str = PARAM) -> Clip:
    """Decode a checked clip into mono float samples at `rate` (channels averaged, resampled by soxr)."""
    try:
        samples, source_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # checked clips decode; this guards a file damaged after its header
        raise _refuse(f"the audio clip could not be decoded: {_reason(e)}", param) from None
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if source_rate != rate:
        mono = soxr.resample(mono, source_rate, rate, quality="HQ")
    return Clip(np.ascontiguousarray(mono, dtype="<f4").tobytes(), rate)


def _reason(error: Exception) -> str:
    """libsndfile's own words, without the file object it names ("Error opening <_io.BytesIO …>: ")."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return re.sub(r"^Error opening <[^>]*>:\s*", "", text.splitlines()[-1])
