"""Audio on the vLLM engine: an audio chat model (the tiny Qwen2-Audio, tests/tiny_audio.py) hears clips through the
official openai client, in chat and in the transcription route; a speech-to-text model (the tiny Whisper,
tests/tiny_whisper.py) answers the transcription routes as transformers' own greedy decode of the same decoder prompt
does, and refuses chats. (A model without an audio encoder is refused by the
service before any engine sees the clip: tests/test_audio_e2e.py proves it once.)

vLLM takes lmserve's token prompt with each clip's marker (`<|audio_bos|><|AUDIO|><|audio_eos|>`, the part of
Qwen2-Audio's numbered placeholder its processor expands) left in it and the clip's samples beside it. Unlike
llama.cpp's projector, which pads every clip to Whisper's 30 s window (750 positions), vLLM's processor gives a clip
the positions of its own length: 25 a second for this encoder (100 mel frames, halved by a strided conv and again by
the pooling).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from lmserve.chat.audio import to_clip
from lmserve.chat.template import ChatTemplate
from lmserve.chat.whisper import LANGUAGES
from lmserve.config import ServerConfig
from lmserve.engine.vllm.args import VllmOptions
from lmserve.engine.vllm.engine import VllmEngine
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import SamplingParams
from tests.audio_clips import RATE, b64, tone
from tests.tiny_audio import tiny_qwen2_audio_repo
from tests.tiny_whisper import tiny_whisper_repo

pytestmark = pytest.mark.asyncio(loop_scope="session")  # vLLM's output handler lives on the loop that first used it

POSITIONS_PER_SECOND = 25


@pytest.fixture(scope="module")
def audio_engine() -> Iterator[VllmEngine]:
    opened = VllmEngine(tiny_qwen2_audio_repo(), VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32"))
    yield opened
    opened.close()
    _KEPT.append(opened)  # as tests/engine/vllm/test_vision.py: a multimodal client's context must outlive the tests


_KEPT: list[VllmEngine] = []


@pytest.fixture(scope="module")
def whisper_engine() -> Iterator[VllmEngine]:
    opened = VllmEngine(tiny_whisper_repo(), VllmOptions(num_ctx=448, num_parallel=2, dtype="float32"))
    yield opened
    opened.close()
    _KEPT.append(opened)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(audio_engine: VllmEngine, whisper_engine: VllmEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai client over "listener", the audio model, and "whisper"."""
    models = [LoadedModel(name="listener", engine=audio_engine, template=ChatTemplate(audio_engine.info.chat_template)),
              LoadedModel(name="whisper", engine=whisper_engine, template=ChatTemplate(None))]
    app = create_app(static_service(models), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test/v1") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)


async def ask(client: openai.AsyncOpenAI, *clips: bytes, model: str = "listener") -> Any:
    parts: list[Any] = [{"type": "text", "text": "What do you hear?"}]
    parts += [{"type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}} for clip in clips]
    return await client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                                temperature=0, max_tokens=4)


async def test_the_audio_model_says_its_marker_and_rate(audio_engine: VllmEngine) -> None:
    assert audio_engine.info.audio_marker == "<|audio_bos|><|AUDIO|><|audio_eos|>"
    assert audio_engine.info.audio_rate == RATE and audio_engine.info.image_marker is None


async def test_a_clip_takes_the_positions_of_its_length(client: openai.AsyncOpenAI) -> None:
    without, one, two = await ask(client), await ask(client, tone(1.0)), await ask(client, tone(2.0, fmt="FLAC"))
    marker = 3  # <|audio_bos|><|AUDIO|><|audio_eos|> in the prompt, <|AUDIO|> expanded
    assert one.usage.prompt_tokens == without.usage.prompt_tokens + marker - 1 + POSITIONS_PER_SECOND
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + POSITIONS_PER_SECOND
    assert one.choices[0].message.content and one.usage.completion_tokens == 4


async def test_two_clips_in_one_message(client: openai.AsyncOpenAI) -> None:
    one, both = await ask(client, tone(1.0)), await ask(client, tone(1.0), tone(1.0, hertz=880))
    assert both.usage.prompt_tokens == one.usage.prompt_tokens + 2 + POSITIONS_PER_SECOND


async def test_a_transcription_through_the_openai_client(client: openai.AsyncOpenAI) -> None:
    transcript = await client.audio.transcriptions.create(model="listener", file=("note.mp3", tone(1.0, fmt="MP3")))
    assert transcript.text and transcript.usage is not None and transcript.usage.type == "tokens"
    assert transcript.usage.input_tokens > POSITIONS_PER_SECOND



# ---- a speech-to-text model (Whisper) ----


def heard_language(clip: bytes) -> str:
    """The language transformers' own forward pass of the tiny Whisper puts first after `<|startoftranscript|>` over
    `clip`, among Whisper's language tokens (for the tests' clip the first two are 0.07 apart in log-probability: no
    rounding flips them)."""
    import soundfile
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(tiny_whisper_repo())
    model = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_repo(), dtype=torch.float32).eval()
    samples, rate = soundfile.read(io.BytesIO(clip), dtype="float32")
    features = processor.feature_extractor(samples, sampling_rate=rate, return_tensors="pt").input_features
    ids = processor.tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", *(f"<|{c}|>" for c in LANGUAGES)])
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([ids[:1]])).logits[0, -1]
    return LANGUAGES[int(logits[ids[1:]].argmax())]


async def engine_decode(engine: VllmEngine, prompt: str, clip: bytes, steps: int) -> str:
    """The engine's own greedy decode of `steps` tokens after the decoder prompt `prompt`, `clip` to the encoder."""
    tokens, places = engine.tokenize_media(prompt, [to_clip(clip, RATE)])
    stream = engine.submit(tokens, SamplingParams(temperature=0.0, max_tokens=steps), images=places)
    return "".join([chunk.text async for chunk in stream]).strip()


async def test_whisper_is_a_transcriber_at_16_khz(whisper_engine: VllmEngine) -> None:
    info = whisper_engine.info
    assert (info.transcriber, info.audio_rate, info.audio_marker, info.image_marker) == (True, RATE, None, None)


async def test_a_whisper_transcript_is_its_decoder_prompt_in_the_language_given(
        client: openai.AsyncOpenAI, whisper_engine: VllmEngine) -> None:
    clip = tone(2.0)
    transcript = await client.audio.transcriptions.create(model="whisper", file=("note.wav", clip), language="DE",
                                                          extra_body={"max_tokens": 8})
    expected = await engine_decode(whisper_engine, "<|startoftranscript|><|de|><|transcribe|><|notimestamps|>",
                                   clip, 8)
    assert transcript.text.strip() == expected and expected
    assert transcript.usage is not None and transcript.usage.input_tokens == 4  # the decoder's prompt
    assert transcript.usage.output_tokens == 8


async def test_a_whisper_translation_asks_the_language_first_and_a_prompt_is_the_text_before(
        client: openai.AsyncOpenAI, whisper_engine: VllmEngine) -> None:
    clip = tone(1.0, hertz=300, fmt="FLAC")
    heard = heard_language(clip)
    with warnings.catch_warnings():  # the openai client marks its translations call deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        translation = await client.audio.translations.create(model="whisper", file=("note.flac", clip),
                                                             extra_body={"max_tokens": 6})
    assert translation.text.strip() == await engine_decode(
        whisper_engine, f"<|startoftranscript|><|{heard}|><|translate|><|notimestamps|>", clip, 6)
    before = await client.audio.transcriptions.create(model="whisper", file=("note.flac", clip), language="en",
                                                      prompt="Hello there", extra_body={"max_tokens": 6})
    assert before.text.strip() == await engine_decode(
        whisper_engine, "<|startofprev|> Hello there<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
        clip, 6)


async def test_whisper_refuses_chats_and_unknown_languages(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="speech-to-text model: it answers /v1/audio/transcriptions"):
        await ask(client, tone(1.0), model="whisper")
    with pytest.raises(openai.BadRequestError, match="speech-to-text model"):
        await client.completions.create(model="whisper", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="language 'klingon' is not one Whisper knows") as bad:
        await client.audio.transcriptions.create(model="whisper", file=("note.wav", tone(1.0)), language="klingon")
    assert bad.value.body["param"] == "language"  # type: ignore[index]
