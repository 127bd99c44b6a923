"""Speech to text (the `openai` client's `audio.transcriptions.create` and `audio.translations.create`), answered by
an audio chat model (one with an audio encoder) given a fixed instruction and the clip, or by a speech-to-text model
(Whisper on vLLM) prompted as it was trained (`ChatRequest.speech`: service/transcribing.py).

    POST /v1/audio/transcriptions   multipart: `file`, `model`, optional `language`, `prompt`, `response_format`
                                    (json | text | srt | vtt | verbose_json), `temperature`,
                                    `timestamp_granularities[]` (segment), `stream` (json and text),
                                    `max_tokens` (llama-server's: the transcript's token limit)
    POST /v1/audio/translations     multipart: `file`, `model`, optional `prompt`, `response_format`, `temperature`:
                                    the speech in English

No timestamps are asked of either (Whisper is prompted with `<|notimestamps|>`): the transcript is one segment
spanning the clip (srt, vtt, verbose_json); word timestamps are a 400 saying so. Streamed, the transcript comes as
`transcript.text.delta` events and one `transcript.text.done`. The clip is checked as chat audio is (chat/audio.py:
format, bytes, seconds); a model without an audio encoder is a 400 naming it. Errors are in the OpenAI shape.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmserve.chat.audio import check_audio
from lmserve.dialects.openai.output import error_frame
from lmserve.dialects.shared.state import MediaDep, ServiceDep
from lmserve.dialects.shared.streaming import GenerationResponse, guarded_errors, sse_json, until_disconnect
from lmserve.errors import InvalidRequest
from lmserve.service.generation_stream import Generation
from lmserve.types import (
    AUDIO_PLACEHOLDER,
    ChatRequest,
    Chunk,
    Message,
    RequestOptions,
    SamplingParams,
    Speech,
    Usage,
)

ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]
Task = Literal["transcribe", "translate"]
TOKENS_PER_SECOND = 16
"""The most tokens a transcript may have per second of the clip (speech is about 3 to 5), past a base of 64: a model
that never stops ends there."""


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    """One transcription or translation, as the form gave it."""

    task: Task
    model: str
    clip: bytes
    seconds: float
    language: str | None
    prompt: str | None
    temperature: float
    max_tokens: int | None = None
    """llama-server's extension: the most tokens of the transcript (None: TOKENS_PER_SECOND of the clip)."""


def instruction(speech: SpeechRequest) -> str:
    """What the model is asked, before the clip: transcribe word for word (in the language given), or translate."""
    if speech.task == "translate":
        text = "Translate the speech in this audio clip into English. Reply with the English translation only."
    else:
        language = f" The speech is in the language with code {speech.language!r}." if speech.language else ""
        text = f"Transcribe the speech in this audio clip word for word.{language} Reply with the transcript only."
    if speech.prompt:
        text += f" The text before it, and the spelling to follow: {speech.prompt}"
    return text


def chat_request(speech: SpeechRequest, *, logprobs: bool) -> ChatRequest:
    """The chat turn that answers `speech` (each token's log-probability kept with `logprobs`: verbose_json)."""
    message = Message("user", instruction(speech) + "\n" + AUDIO_PLACEHOLDER, audio=[speech.clip])
    options = RequestOptions(values={"temperature": speech.temperature})
    limit = speech.max_tokens or 64 + math.ceil(TOKENS_PER_SECOND * speech.seconds)
    sampling = SamplingParams(max_tokens=limit, logprobs=0 if logprobs else None)
    return ChatRequest(model=speech.model, messages=[message], sampling=sampling, think=False, options=options,
                       speech=Speech(speech.task, speech.language, speech.prompt))


def timestamp(seconds: float, separator: str) -> str:
    """`HH:MM:SS,mmm` (SubRip, separator ",") or `HH:MM:SS.mmm` (WebVTT, ".")."""
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{separator}{rest % 1000:03d}"


def subtitles(text: str, seconds: float, kind: Literal["srt", "vtt"]) -> str:
    """The transcript as one cue spanning the clip."""
    if kind == "srt":
        return f"1\n{timestamp(0, ',')} --> {timestamp(seconds, ',')}\n{text}\n\n"
    return f"WEBVTT\n\n{timestamp(0, '.')} --> {timestamp(seconds, '.')}\n{text}\n\n"


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's token usage of a transcription (the prompt's tokens hold the clip's)."""
    return {"type": "tokens", "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def segment(speech: SpeechRequest, text: str, final: Chunk) -> dict[str, Any]:
    """The one segment: the whole clip, its tokens and their mean log-probability, the text's gzip ratio (as
    Whisper's, long repeats score high); no_speech_prob is 0 (a chat model does not say)."""
    tokens = [entry.token for entry in final.logprobs]
    mean = sum(entry.logprob for entry in final.logprobs) / len(tokens) if tokens else 0.0
    raw = text.encode()
    ratio = len(raw) / len(zlib.compress(raw)) if raw else 0.0
    return {"id": 0, "seek": 0, "start": 0.0, "end": round(speech.seconds, 3), "text": text, "tokens": tokens,
            "temperature": speech.temperature, "avg_logprob": round(mean, 6), "compression_ratio": round(ratio, 6),
            "no_speech_prob": 0.0}


def verbose(speech: SpeechRequest, text: str, final: Chunk, granularities: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {"task": "translate" if speech.task == "translate" else "transcribe",
                            "language": "english" if speech.task == "translate" else (speech.language or ""),
                            "duration": round(speech.seconds, 3), "text": text}
    if not granularities or "segment" in granularities:
        body["segments"] = [segment(speech, text, final)]
    return body | {"usage": {"type": "duration", "seconds": round(speech.seconds, 3)}}


def answer(speech: SpeechRequest, text: str, final: Chunk, usage: Usage, fmt: ResponseFormat,
           granularities: list[str]) -> Response:
    text = text.strip()
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt in ("srt", "vtt"):
        kind: Literal["srt", "vtt"] = "srt" if fmt == "srt" else "vtt"
        return PlainTextResponse(subtitles(text, speech.seconds, kind),
                                 media_type="text/vtt" if kind == "vtt" else "text/plain")
    if fmt == "verbose_json":
        return JSONResponse(verbose(speech, text, final, granularities))
    return JSONResponse({"text": text, "usage": usage_body(usage)})


async def stream_events(generation: Generation) -> AsyncIterator[bytes]:
    """`transcript.text.delta` per piece of text, then `transcript.text.done` with the whole and its usage."""
    parts: list[str] = []
    usage = Usage()
    async for chunk in generation:
        if chunk.text:
            delta = chunk.text.lstrip() if not parts else chunk.text
            if delta:
                parts.append(delta)
                yield sse_json({"type": "transcript.text.delta", "delta": delta})
        if chunk.usage is not None:
            usage = chunk.usage
    text = "".join(parts).rstrip()
    yield sse_json({"type": "transcript.text.done", "text": text, "usage": usage_body(usage)})


async def speech_request(task: Task, policy: MediaDep, file: UploadFile, model: str, language: str | None,
                         prompt: str | None, temperature: float, max_tokens: int | None) -> SpeechRequest:
    if not model.strip():
        raise InvalidRequest("you must name a model", param="model")
    data = await file.read()
    if not data:
        raise InvalidRequest("the uploaded file is empty", param="file")
    info = check_audio(data, policy, param="file")
    return SpeechRequest(task, model, data, info.seconds, language or None, prompt or None, temperature, max_tokens)


async def respond(service: ServiceDep, speech: SpeechRequest, fmt: ResponseFormat, granularities: list[str],
                  stream: bool, request: Request) -> Response:
    if "word" in granularities:
        raise InvalidRequest("word timestamps are not available: lmserve asks no model for timestamps (only "
                             "'segment', one segment spanning the clip)", param="timestamp_granularities[]")
    if granularities and fmt != "verbose_json":
        raise InvalidRequest("timestamp_granularities needs response_format 'verbose_json'",
                             param="timestamp_granularities[]")
    if stream and fmt not in ("json", "text"):
        raise InvalidRequest(f"streaming is not available for response_format {fmt!r} (only json and text)",
                             param="stream")
    generation = await service.generation.chat(chat_request(speech, logprobs=fmt == "verbose_json"))
    if stream:
        return GenerationResponse(generation, guarded_errors(stream_events(generation), error_frame))
    text, final = await until_disconnect(generation.collect(), request.receive)
    usage = final.usage if final.usage is not None else Usage(prompt_tokens=generation.num_prompt_tokens)
    return answer(speech, text, final, usage, fmt, granularities)


router = APIRouter(prefix="/v1")

FileField = Annotated[UploadFile, File(description="the audio clip: WAV, FLAC, OGG or MP3")]
ModelField = Annotated[str, Form()]
FormatField = Annotated[ResponseFormat, Form()]
TemperatureField = Annotated[float, Form(ge=0, le=2)]
MaxTokensField = Annotated[int | None, Form(ge=1)]


@router.post("/audio/transcriptions", response_model=None)
async def transcriptions(
    service: ServiceDep, policy: MediaDep, request: Request, file: FileField, model: ModelField,
    language: Annotated[str | None, Form()] = None, prompt: Annotated[str | None, Form()] = None,
    response_format: FormatField = "json", temperature: TemperatureField = 0.0,
    timestamp_granularities: Annotated[list[Literal["word", "segment"]] | None,
                                       Form(alias="timestamp_granularities[]")] = None,
    stream: Annotated[bool, Form()] = False, max_tokens: MaxTokensField = None,
) -> Response:
    speech = await speech_request("transcribe", policy, file, model, language, prompt, temperature, max_tokens)
    return await respond(service, speech, response_format, list(timestamp_granularities or ()), stream, request)


@router.post("/audio/translations", response_model=None)
async def translations(
    service: ServiceDep, policy: MediaDep, request: Request, file: FileField, model: ModelField,
    prompt: Annotated[str | None, Form()] = None, response_format: FormatField = "json",
    temperature: TemperatureField = 0.0, max_tokens: MaxTokensField = None,
) -> Response:
    speech = await speech_request("translate", policy, file, model, None, prompt, temperature, max_tokens)
    return await respond(service, speech, response_format, [], False, request)
