"""The llama.cpp projector's audio windows (lmserve/engine/llamacpp/vision.py): a clip of a whole number of 30 s
windows is not given one more window of padding alone; with the tiny random Qwen2-Audio (tests/tiny_audio.py), whose
projector llama.cpp preprocesses the Whisper way."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.llamacpp.vision import WHISPER_WINDOW, padding_window
from lmserve.types import Clip, LoadOptions
from tests.tiny_audio import POSITIONS_PER_WINDOW, tiny_qwen2_audio_gguf


def test_only_a_clip_of_whole_windows_gets_a_window_of_padding() -> None:
    assert padding_window(WHISPER_WINDOW, 2)  # 30 s: the second window is the 30 s of padding
    assert padding_window(WHISPER_WINDOW - 160, 2) and padding_window(WHISPER_WINDOW + 40, 2)
    assert padding_window(3 * WHISPER_WINDOW, 4)
    assert not padding_window(WHISPER_WINDOW + 41, 2)  # the second window starts with the clip's last samples
    assert not padding_window(WHISPER_WINDOW - 161, 1)  # under 30 s: one window, of clip and padding
    assert not padding_window(WHISPER_WINDOW // 2, 1)
    assert not padding_window(WHISPER_WINDOW, 1)  # another preprocessor's count: left alone
    assert not padding_window(2 * WHISPER_WINDOW, 2)


@pytest.fixture(scope="module")
def backend() -> Iterator[LlamaCppBackend]:
    model, projector = tiny_qwen2_audio_gguf()
    loaded = LlamaCppBackend(model, LoadOptions(num_ctx=4096, num_parallel=1, num_batch=512,
                                                projector=str(projector)), LlamaCppLaunch())
    yield loaded
    loaded.close()


def tone(samples: int) -> Clip:
    wave = 0.3 * np.sin(2 * np.pi * 440 * np.arange(samples) / 16_000)
    return Clip(wave.astype("<f4").tobytes(), 16_000)


@pytest.mark.parametrize(("seconds", "windows"), [(29.5, 1), (30.0, 1), (30.5, 2), (60.0, 2)])
def test_a_clip_takes_a_window_per_started_30_seconds(backend: LlamaCppBackend, seconds: float,
                                                       windows: int) -> None:
    marker = backend.info.audio_marker
    assert marker is not None
    _, places = backend.tokenize_media(f"Listen: {marker}", [tone(int(seconds * 16_000))])
    assert [place.length for place in places] == [POSITIONS_PER_WINDOW] * windows
