"""Audio clips for the tests, synthesized: tones and silence in any format libsndfile writes."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile

RATE = 16_000
"""Whisper's rate, the one the tiny audio model's encoder takes."""


def tone(seconds: float = 1.0, *, hertz: float = 440.0, rate: int = RATE, fmt: str = "WAV",
         channels: int = 1) -> bytes:
    """A sine tone (silence at `hertz` 0) as an audio file of `fmt` (libsndfile's name: WAV, FLAC, OGG, MP3)."""
    times = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * hertz * times)).astype(np.float32)
    frames = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    buffer = io.BytesIO()
    soundfile.write(buffer, frames, rate, format=fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
