"""Whisper's decoder prompts: how an encoder-decoder speech-to-text model is asked for a transcript or a translation.

The clip goes to the encoder; the decoder starts from `<|startoftranscript|>`, the clip's language, the task and
`<|notimestamps|>` (lmserve gives no timestamps), after `<|startofprev|>` and the text that came before when the
request has a `prompt` (Whisper's own conditioning: the spelling and style to follow). Without a language the model
is asked for it first: one token after `<|startoftranscript|>`, among the language tokens (service/transcribing.py).
"""

from __future__ import annotations

from lmserve.errors import InvalidRequest
from lmserve.types import Speech

START = "<|startoftranscript|>"
PREVIOUS = "<|startofprev|>"
NO_TIMESTAMPS = "<|notimestamps|>"
_CODES = ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
          "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
          "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue")
LANGUAGES = tuple(_CODES.split(" "))
"""Whisper's language codes (ISO 639-1, and haw, yue), in the order of its vocabulary's language tokens."""


def language_token(code: str) -> str:
    return f"<|{code}|>"


def language_code(given: str) -> str:
    """A request's `language` as one of LANGUAGES (case and surrounding space ignored); 400 otherwise."""
    code = given.strip().lower()
    if code not in LANGUAGES:
        raise InvalidRequest(f"language {given!r} is not one Whisper knows: give an ISO 639-1 code (en, de, fr, "
                             "es, zh …)", param="language")
    return code


def decoder_prompt(speech: Speech, language: str) -> str:
    """The decoder's prompt for `speech` in `language` (a code of LANGUAGES)."""
    before = f"{PREVIOUS} {speech.prompt.strip()}" if speech.prompt and speech.prompt.strip() else ""
    return f"{before}{START}{language_token(language)}<|{speech.task}|>{NO_TIMESTAMPS}"
