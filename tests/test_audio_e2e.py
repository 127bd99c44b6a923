"""End to end (llama.cpp): audio clips through the real server and the official clients.

One server serves the tiny random Qwen2-Audio (tests/tiny_audio.py: its GGUF and audio projector converted by
llama.cpp's own converter) with `--audio-max-seconds 5`; the embedded SmolLM2 is there too, as a model that cannot
hear. The model is random: what it says means nothing, so the tests check where the clip went (its 750 prompt
positions, the prompt cache), the shapes the clients parse, and every refusal.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.audio_clips import b64, tone
from tests.test_server import MODEL, Server
from tests.tiny_audio import POSITIONS_PER_WINDOW, tiny_qwen2_audio_gguf

AUDIO_MODEL = "tiny-qwen2-audio-v3:latest"  # the served file's stem
CLIP = tone(1.0)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    model, projector = tiny_qwen2_audio_gguf()
    srv = Server("-m", str(model), "--mmproj", str(projector), "-c", "2048", "-np", "2", "-t", "1",
                 "--audio-max-seconds", "5")
    yield srv
    log = srv.stop()
    assert "Traceback" not in log, log  # every refusal is a handled 400, never a crash


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client().with_options(timeout=120) as c:
        yield c


def ask(client: openai.OpenAI, *clips: bytes, fmt: str = "wav", model: str = AUDIO_MODEL,
        text: str = "What do you hear?") -> Any:
    parts: list[Any] = [{"type": "text", "text": text}]
    parts += [{"type": "input_audio", "input_audio": {"data": b64(clip), "format": fmt}} for clip in clips]
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                          temperature=0, max_tokens=4)


# ---- chat with input_audio ----


def test_a_clip_takes_its_positions_in_the_prompt(client: openai.OpenAI) -> None:
    text_only = ask(client)
    one, two = ask(client, CLIP), ask(client, CLIP, tone(2.0, hertz=880))
    assert text_only.usage is not None and one.usage is not None and two.usage is not None
    per_clip = POSITIONS_PER_WINDOW + 2  # its embeddings, between <|audio_bos|> and <|audio_eos|>
    assert one.usage.prompt_tokens == text_only.usage.prompt_tokens + per_clip
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + per_clip
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 4


def test_the_same_clip_again_is_found_in_the_prompt_cache_and_another_is_not(client: openai.OpenAI) -> None:
    clip = tone(1.0, hertz=300)
    ask(client, clip, text="Tell me about this clip.")
    again = ask(client, clip, text="Tell me about this clip.")
    other = ask(client, tone(1.0, hertz=301), text="Tell me about this clip.")
    cached = [(reply.usage.prompt_tokens_details.cached_tokens or 0) for reply in (again, other)]
    assert cached[0] >= POSITIONS_PER_WINDOW  # the clip was not encoded into the slot again
    assert cached[1] < POSITIONS_PER_WINDOW  # a clip of other samples is another prompt from its first position


@pytest.mark.parametrize("fmt", ["MP3", "FLAC", "OGG"])
def test_other_formats_and_rates_are_heard(client: openai.OpenAI, fmt: str) -> None:
    reply = ask(client, tone(1.0, rate=44_100, fmt=fmt, channels=2), fmt=fmt.lower())
    assert reply.usage.prompt_tokens == ask(client, CLIP).usage.prompt_tokens


def test_vllms_audio_url_parts_are_heard_and_guarded_as_image_urls_are(client: openai.OpenAI) -> None:
    def by_url(url: str) -> Any:
        parts: Any = [{"type": "text", "text": "What do you hear?"}, {"type": "audio_url", "audio_url": {"url": url}}]
        return client.chat.completions.create(model=AUDIO_MODEL, messages=[{"role": "user", "content": parts}],
                                              temperature=0, max_tokens=4)

    assert by_url("data:audio/wav;base64," + b64(CLIP)).usage.prompt_tokens == ask(client, CLIP).usage.prompt_tokens
    local = refusal(lambda: by_url("http://127.0.0.1:9/note.wav"))
    assert local["param"] == "messages" and local["message"].startswith("messages[0].content[1].audio_url.url: ")
    assert "loopback address" in local["message"]


def test_text_and_audio_requests_share_the_batch(client: openai.OpenAI) -> None:
    jobs = [(CLIP,), (), (tone(0.5, hertz=600),), ()]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda clips: ask(client, *clips), jobs))
    assert [reply.usage.prompt_tokens > POSITIONS_PER_WINDOW for reply in replies] == [True, False, True, False]


def test_the_native_chat_takes_a_clip_among_its_images(server: Server) -> None:
    with ollama.Client(host=server.base_url, timeout=120) as native:
        with_clip = native.chat(model=AUDIO_MODEL, options={"temperature": 0, "num_predict": 2},
                                messages=[{"role": "user", "content": "Listen.", "images": [b64(CLIP)]}])
        without = native.chat(model=AUDIO_MODEL, options={"temperature": 0, "num_predict": 2},
                              messages=[{"role": "user", "content": "Listen."}])
    assert (with_clip.prompt_eval_count or 0) >= (without.prompt_eval_count or 0) + POSITIONS_PER_WINDOW


def test_the_responses_api_takes_input_audio(client: openai.OpenAI) -> None:
    def respond(*clips: bytes) -> Any:
        content: list[Any] = [{"type": "input_text", "text": "What do you hear?"}]
        content += [{"type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}} for clip in clips]
        return client.responses.create(model=AUDIO_MODEL, input=[{"role": "user", "content": content}],
                                       max_output_tokens=4, temperature=0, store=False)

    with_clip, without = respond(CLIP), respond()
    assert with_clip.usage.input_tokens == without.usage.input_tokens + POSITIONS_PER_WINDOW + 2


def test_show_lists_audio_not_vision_for_the_audio_model(server: Server) -> None:
    with ollama.Client(host=server.base_url, timeout=120) as native:
        capabilities = native.show(AUDIO_MODEL).capabilities or []
        assert "audio" in capabilities and "vision" not in capabilities
        assert "audio" not in (native.show(MODEL).capabilities or [])


# ---- refusals ----


def refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400
    body: Any = caught.value.body
    return dict(body)


def test_bad_clips_are_400s_naming_the_part(client: openai.OpenAI) -> None:
    corrupt = refusal(lambda: ask(client, b"RIFF\0\0\0\0WAVEjunk"))
    assert corrupt["param"] == "messages[0].content[1].input_audio"
    assert "not a readable audio file" in corrupt["message"]
    long = refusal(lambda: ask(client, tone(6.0)))
    assert "too long: 6.0 s, the limit is 5 s" in long["message"]
    unknown = refusal(lambda: ask(client, CLIP, fmt="m4a"))
    assert "'m4a' is not supported" in unknown["message"]


def test_audio_to_a_model_without_an_audio_encoder_is_a_400(client: openai.OpenAI) -> None:
    body = refusal(lambda: ask(client, CLIP, model=MODEL))
    assert f"model '{MODEL}' has no audio encoder (it cannot hear audio)" in body["message"]


def test_an_image_to_the_audio_only_model_is_a_400(client: openai.OpenAI) -> None:
    png = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFT"
           "kSuQmCC")
    messages: Any = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}]
    body = refusal(lambda: client.chat.completions.create(model=AUDIO_MODEL, messages=messages, max_tokens=2))
    assert "no vision projector" in body["message"]


# ---- /v1/audio/transcriptions and /v1/audio/translations ----


def test_a_transcription_in_each_response_format(client: openai.OpenAI) -> None:
    whole = client.audio.transcriptions.create(model=AUDIO_MODEL, file=("note.wav", CLIP))
    assert whole.text and whole.usage is not None and whole.usage.type == "tokens"
    assert whole.usage.input_tokens > POSITIONS_PER_WINDOW and whole.usage.output_tokens <= 64 + 16
    text = client.audio.transcriptions.create(model=AUDIO_MODEL, file=("note.wav", CLIP), response_format="text")
    srt = client.audio.transcriptions.create(model=AUDIO_MODEL, file=("note.wav", CLIP), response_format="srt")
    vtt = client.audio.transcriptions.create(model=AUDIO_MODEL, file=("note.wav", CLIP), response_format="vtt")
    assert isinstance(text, str) and text.strip()
    assert re.match(r"1\n00:00:00,000 --> 00:00:01,000\n\S", str(srt))
    assert re.match(r"WEBVTT\n\n00:00:00\.000 --> 00:00:01\.000\n\S", str(vtt))
    verbose = client.audio.transcriptions.create(model=AUDIO_MODEL, file=("note.mp3", tone(2.0, fmt="MP3")),
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    [segment] = verbose.segments or []
    assert verbose.duration == pytest.approx(2.0, abs=0.06) and segment.end == verbose.duration
    assert segment.text == verbose.text and segment.avg_logprob <= 0 and segment.tokens


def test_a_streamed_transcription_is_its_deltas_then_done(client: openai.OpenAI) -> None:
    events = list(client.audio.transcriptions.create(model=AUDIO_MODEL, file=("note.wav", CLIP), stream=True))
    deltas = [event.delta for event in events if event.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and deltas and "".join(deltas).rstrip() == done.text
    assert done.usage is not None and done.usage.output_tokens >= len(deltas)


def test_a_translation(client: openai.OpenAI) -> None:
    with warnings.catch_warnings():  # the openai client marks its translations call deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        translated = client.audio.translations.create(model=AUDIO_MODEL, file=("note.flac", tone(1.0, fmt="FLAC")))
    assert translated.text


def test_transcription_refusals(server: Server, client: openai.OpenAI) -> None:
    corrupt = refusal(lambda: client.audio.transcriptions.create(model=AUDIO_MODEL, file=("a.wav", b"junk")))
    assert corrupt["param"] == "file" and "not a readable audio file" in corrupt["message"]
    words = refusal(lambda: client.audio.transcriptions.create(
        model=AUDIO_MODEL, file=("a.wav", CLIP), response_format="verbose_json", timestamp_granularities=["word"]))
    assert "word timestamps are not available" in words["message"]
    deaf = refusal(lambda: client.audio.transcriptions.create(model=MODEL, file=("a.wav", CLIP)))
    assert "has no audio encoder" in deaf["message"]
    missing = httpx.post(f"{server.base_url}/v1/audio/transcriptions", data={"model": AUDIO_MODEL}, timeout=30)
    assert missing.status_code == 400 and "file" in json.dumps(missing.json())
    form = {"model": AUDIO_MODEL, "response_format": "srt", "stream": "true"}
    streamed_srt = httpx.post(f"{server.base_url}/v1/audio/transcriptions", data=form,
                              files={"file": ("a.wav", io.BytesIO(CLIP))}, timeout=30)
    assert streamed_srt.status_code == 400 and "streaming is not available" in streamed_srt.text
