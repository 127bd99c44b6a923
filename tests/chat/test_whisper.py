"""Spec for lmserve.chat.whisper: Whisper's decoder prompts and language codes."""

from __future__ import annotations

import pytest

from lmserve.chat.whisper import LANGUAGES, decoder_prompt, language_code
from lmserve.errors import InvalidRequest
from lmserve.types import Speech


def test_a_transcription_starts_the_transcript_in_its_language_without_timestamps() -> None:
    assert decoder_prompt(Speech("transcribe"), "de") == "<|startoftranscript|><|de|><|transcribe|><|notimestamps|>"


def test_a_translation_names_the_language_it_translates_from() -> None:
    assert decoder_prompt(Speech("translate"), "fr") == "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"


def test_a_prompt_is_the_text_before_after_startofprev() -> None:
    assert decoder_prompt(Speech("transcribe", prompt="  Kubernetes, kubectl.  "), "en") == (
        "<|startofprev|> Kubernetes, kubectl.<|startoftranscript|><|en|><|transcribe|><|notimestamps|>")
    assert decoder_prompt(Speech("transcribe", prompt="   "), "en").startswith("<|startoftranscript|>")


def test_language_codes_are_whispers_hundred() -> None:
    assert len(LANGUAGES) == len(set(LANGUAGES)) == 100 and LANGUAGES[:3] == ("en", "zh", "de")
    assert language_code(" FR ") == "fr" and language_code("yue") == "yue"


@pytest.mark.parametrize("given", ["english", "xx", "", "en-US"])
def test_an_unknown_language_is_a_400_naming_the_field(given: str) -> None:
    with pytest.raises(InvalidRequest, match="is not one Whisper knows") as refused:
        language_code(given)
    assert refused.value.param == "language"
