"""Audio on the vLLM engine: an audio chat model (the tiny Qwen2-Audio, tests/tiny_audio.py) hears clips through the
official openai client, in chat and in the transcription route. (A model without an audio encoder is refused by the
service before any engine sees the clip: tests/test_audio_e2e.py proves it once.)

vLLM takes lmserve's token prompt with each clip's marker (`<|audio_bos|><|AUDIO|><|audio_eos|>`, the part of
Qwen2-Audio's numbered placeholder its processor expands) left in it and the clip's samples beside it. Unlike
llama.cpp's projector, which pads every clip to Whisper's 30 s window (750 positions), vLLM's processor gives a clip
the positions of its own length: 25 a second for this encoder (100 mel frames, halved by a strided conv and again by
the pooling).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.vllm.args import VllmOptions
from lmserve.engine.vllm.engine import VllmEngine
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from tests.audio_clips import RATE, b64, tone
from tests.tiny_audio import tiny_qwen2_audio_repo

pytestmark = pytest.mark.asyncio(loop_scope="session")  # vLLM's output handler lives on the loop that first used it

POSITIONS_PER_SECOND = 25


@pytest.fixture(scope="module")
def audio_engine() -> Iterator[VllmEngine]:
    opened = VllmEngine(tiny_qwen2_audio_repo(), VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32"))
    yield opened
    opened.close()
    _KEPT.append(opened)  # as tests/engine/vllm/test_vision.py: a multimodal client's context must outlive the tests


_KEPT: list[VllmEngine] = []


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(audio_engine: VllmEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai client over "listener", the audio model."""
    models = [LoadedModel(name="listener", engine=audio_engine, template=ChatTemplate(audio_engine.info.chat_template))]
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

