"""The prompt of a speech-to-text model (Whisper: `ModelInfo.transcriber`): its decoder's, made from the request's
`Speech` (chat/whisper.py), with its one clip for the encoder. A chat to such a model, or a clip it cannot take, is
a 400 saying what it answers.

Without a language the model is asked first, as Whisper itself does: one greedy token after `<|startoftranscript|>`
over the same clip, every language token the vocabulary has raised far above the rest (`logit_bias`), so the
likeliest language wins.
"""

from __future__ import annotations

from lmserve.chat.whisper import LANGUAGES, START, decoder_prompt, language_code, language_token
from lmserve.engine.protocol import PromptImage
from lmserve.errors import InvalidRequest
from lmserve.service import prompts
from lmserve.service.residency import LoadedModel
from lmserve.types import ChatRequest, SamplingParams

LANGUAGE_BIAS = 100.0
"""Added to each language token's logit when the language is asked for: more than any logit of a trained model."""


def the_clip(model: LoadedModel, request: ChatRequest) -> bytes:
    """The one clip a speech-to-text request carries; 400 for a chat or anything else."""
    clips = [clip for message in request.messages for clip in message.audio]
    if request.speech is None or len(clips) != 1 or any(message.images for message in request.messages):
        raise InvalidRequest(f"model '{model.name}' is a speech-to-text model: it answers "
                             "/v1/audio/transcriptions and /v1/audio/translations, not chats", param="model")
    return clips[0]


async def speech_prompt(model: LoadedModel, request: ChatRequest) -> tuple[str, list[int], list[PromptImage]]:
    """The decoder's prompt of a speech-to-text request, its tokens and the clip's place (see the module)."""
    clip = the_clip(model, request)
    speech = request.speech
    assert speech is not None
    if speech.language is not None:
        language = language_code(speech.language)
        if language not in language_ids(model):
            raise InvalidRequest(f"model '{model.name}' has no token for language {language!r}", param="language")
    else:
        language = await detect_language(model, clip)
    text = decoder_prompt(speech, language)
    tokens, places = await prompts.tokenize_prompt(model, text, [clip])
    return text, tokens, places


def language_ids(model: LoadedModel) -> dict[str, int]:
    """The language codes whose token the model's vocabulary has, with its id."""
    found: dict[str, int] = {}
    for code in LANGUAGES:
        ids = model.engine.tokenize(language_token(code), add_special=False, parse_special=True)
        if len(ids) == 1:
            found[code] = ids[0]
    return found


async def detect_language(model: LoadedModel, clip: bytes) -> str:
    """The language the model hears in `clip` (English when it has no language tokens)."""
    ids = language_ids(model)
    if not ids:
        return "en"
    tokens, places = await prompts.tokenize_prompt(model, START, [clip])
    bias = {token: LANGUAGE_BIAS for token in ids.values()}
    stream = model.engine.submit(tokens, SamplingParams(temperature=0.0, max_tokens=1, logit_bias=bias),
                                 images=places)
    try:
        async for chunk in stream:
            if chunk.error:
                raise InvalidRequest(f"the model could not tell the clip's language: {chunk.error}",
                                     param="language")
    except BaseException:
        stream.abort()
        raise
    by_id = {token: code for code, token in ids.items()}
    return next((by_id[token] for token in stream.output_tokens if token in by_id), "en")
