"""Audio clips in requests (lmserve/chat/audio.py): the formats libsndfile reads, checked within the byte and duration
limits, decoded to mono at the model's rate; every refusal a 400 saying why."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.chat.audio import check_audio, decode_base64, format_name, is_audio, load_url, to_clip
from lmserve.chat.media import MediaPolicy
from lmserve.errors import InvalidRequest
from tests.audio_clips import b64, tone
from tests.chat.conftest import Server, reply
from tests.chat.test_media import LOCAL

POLICY = MediaPolicy(max_audio_seconds=5.0, max_bytes=2_000_000)
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 16


@pytest.mark.parametrize("fmt, name", [("WAV", "wav"), ("FLAC", "flac"), ("OGG", "ogg"), ("MP3", "mp3")])
def test_each_format_is_checked_and_known_by_its_header(fmt: str, name: str) -> None:
    data = tone(1.5, rate=22_050, fmt=fmt)
    assert is_audio(data)
    info = check_audio(data, POLICY)
    assert info.format == name and info.rate == 22_050 and info.channels == 1
    assert info.seconds == pytest.approx(1.5, abs=0.06)  # MP3 frames pad the end a little


def test_images_are_not_audio() -> None:
    assert not is_audio(PNG) and not is_audio(JPEG) and not is_audio(b"RIFF\0\0\0\0WEBPVP8 ")


@pytest.mark.parametrize("given, name", [("wav", "wav"), ("audio/mpeg", "mp3"), (".FLAC", "flac"), ("opus", "ogg"),
                                         ("audio/x-wav", "wav")])
def test_format_names_clients_use(given: str, name: str) -> None:
    assert format_name(given) == name


def test_an_unsupported_format_name_is_refused_listing_the_supported() -> None:
    with pytest.raises(InvalidRequest, match=r"audio format 'm4a' is not supported \(supported: wav, flac, ogg, mp3\)"):
        format_name("m4a")


def test_a_clip_over_the_duration_limit_is_refused_naming_the_flag() -> None:
    with pytest.raises(InvalidRequest, match=r"too long: 6.0 s, the limit is 5 s \(--audio-max-seconds\)"):
        check_audio(tone(6.0), POLICY)


def test_a_clip_over_the_byte_limit_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="too large"):
        check_audio(tone(2.0), MediaPolicy(max_bytes=1000))


@pytest.mark.parametrize("data, why", [
    (b"RIFF\0\0\0\0WAVEjunk", "No 'data' chunk"),
    (b"not audio at all", "not a readable audio file"),
    (PNG, "not a readable audio file"),
])
def test_corrupt_or_other_files_are_refused_saying_why(data: bytes, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why) as caught:
        check_audio(data, POLICY, param="file")
    assert caught.value.param == "file" and "BytesIO" not in caught.value.message


def test_an_empty_clip_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        check_audio(tone(0.0), POLICY)


def test_base64_input_audio_is_decoded_and_checked() -> None:
    data = tone(0.5)
    assert decode_base64(b64(data), "wav", POLICY) == data
    assert decode_base64("data:audio/wav;base64," + b64(data), "wav", POLICY) == data
    with pytest.raises(InvalidRequest, match="not valid base64"):
        decode_base64("@@@", "wav", POLICY)
    with pytest.raises(InvalidRequest, match="'aac' is not supported"):
        decode_base64(b64(data), "aac", POLICY)


def test_a_clip_is_decoded_to_mono_at_the_models_rate() -> None:
    stereo = tone(1.0, rate=44_100, channels=2, fmt="FLAC")
    clip = to_clip(stereo, 16_000)
    samples = np.frombuffer(clip.samples, dtype="<f4")
    assert clip.rate == 16_000 and len(samples) == 16_000 and clip.seconds == pytest.approx(1.0)
    assert 0.29 < float(np.abs(samples).max()) < 0.31  # the tone's amplitude, kept through mixing and resampling
    assert to_clip(tone(1.0), 16_000).samples == to_clip(tone(1.0), 16_000).samples


# --- audio_url: data URIs and the image fetcher's guard ---------------------------------------------------------------


async def test_an_audio_url_data_uri_is_decoded_and_checked() -> None:
    clip = tone(0.5)
    assert await load_url("data:audio/wav;base64," + b64(clip), POLICY) == clip
    with pytest.raises(InvalidRequest, match="'image/png' is not audio"):
        await load_url("data:image/png;base64," + b64(clip), POLICY)
    with pytest.raises(InvalidRequest, match="not a readable audio file"):
        await load_url("data:audio/wav;base64," + b64(b"RIFF0000WAVEjunk"), POLICY)


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://example.org/a.wav", "http\\(s\\) URL or a data: URI"),
    ("file:///etc/passwd", "http\\(s\\) URL or a data: URI"),
    ("http://127.0.0.1:9/a.wav", "audio host '127.0.0.1' resolves to a loopback address"),
    ("http://169.254.169.254/a.wav", "cloud metadata"),
    ("http://10.1.2.3/a.wav", "private"),
])
async def test_an_audio_url_obeys_the_image_fetchers_ssrf_rules(url: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        await load_url(url, POLICY)


async def test_an_audio_url_is_fetched_from_an_allowed_host_and_checked(server: Server) -> None:
    clip = tone(0.5)
    server.routes["/a.wav"] = reply("200 OK", {"Content-Type": "audio/wav", "Content-Length": str(len(clip))}, clip)
    server.routes["/page"] = reply("200 OK", {"Content-Type": "text/html"}, b"<html></html>")
    server.routes["/fake.wav"] = reply("200 OK", {"Content-Type": "audio/wav"}, b"not a clip")
    assert await load_url(server.base + "/a.wav", LOCAL) == clip
    with pytest.raises(InvalidRequest, match="audio URL content type 'text/html' is not audio"):
        await load_url(server.base + "/page", LOCAL)
    with pytest.raises(InvalidRequest, match="not a readable audio file"):
        await load_url(server.base + "/fake.wav", LOCAL)
    with pytest.raises(InvalidRequest, match="audio URL answered HTTP 404"):
        await load_url(server.base + "/missing.wav", LOCAL)
