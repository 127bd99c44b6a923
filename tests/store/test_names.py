"""Spec for lmserve.store.names: name[:tag], namespace/name[:tag], hf.co/<org>/<repo>[:QUANT], .gguf paths."""

from __future__ import annotations

import pytest

from lmserve.errors import InvalidRequest
from lmserve.store.names import ModelName, is_gguf_path, parse_name


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        ("llama3", ModelName(None, None, "llama3", "latest"), "llama3:latest"),
        ("llama3:latest", ModelName(None, None, "llama3", "latest"), "llama3:latest"),
        ("smollm2:135m", ModelName(None, None, "smollm2", "135m"), "smollm2:135m"),
        (
            "llama3.2:3b-instruct-q4_K_M",
            ModelName(None, None, "llama3.2", "3b-instruct-q4_K_M"),
            "llama3.2:3b-instruct-q4_K_M",
        ),
        ("LiquidAI/lfm2", ModelName(None, "LiquidAI", "lfm2", "latest"), "LiquidAI/lfm2:latest"),
        ("me/my_model-v2:1.0", ModelName(None, "me", "my_model-v2", "1.0"), "me/my_model-v2:1.0"),
        (
            "hf.co/LiquidAI/LFM2-1.2B-GGUF",
            ModelName("hf.co", "LiquidAI", "LFM2-1.2B-GGUF", "latest"),
            "hf.co/LiquidAI/LFM2-1.2B-GGUF:latest",
        ),
        (
            "hf.co/LiquidAI/LFM2-1.2B-GGUF:Q4_K_M",
            ModelName("hf.co", "LiquidAI", "LFM2-1.2B-GGUF", "Q4_K_M"),
            "hf.co/LiquidAI/LFM2-1.2B-GGUF:Q4_K_M",
        ),
        ("hf.co/org/repo:q8_0", ModelName("hf.co", "org", "repo", "Q8_0"), "hf.co/org/repo:Q8_0"),
        ("hf.co/org/repo:Latest", ModelName("hf.co", "org", "repo", "latest"), "hf.co/org/repo:latest"),
        ("HF.CO/org/repo", ModelName("hf.co", "org", "repo", "latest"), "hf.co/org/repo:latest"),
        ("huggingface.co/org/repo:IQ3_XXS", ModelName("hf.co", "org", "repo", "IQ3_XXS"), "hf.co/org/repo:IQ3_XXS"),
        ("a" * 128, ModelName(None, None, "a" * 128, "latest"), "a" * 128 + ":latest"),
    ],
)
def test_valid_names_parse_to_parts_and_print_canonically(text: str, expected: ModelName, canonical: str) -> None:
    name = parse_name(text)
    assert name == expected
    assert str(name) == canonical
    assert parse_name(str(name)) == name


@pytest.mark.parametrize(("text", "is_hub"), [("llama3", False), ("ns/llama3:7b", False), ("hf.co/o/r:Q4_0", True)])
def test_is_hub(text: str, is_hub: bool) -> None:
    assert parse_name(text).is_hub is is_hub


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("", "empty"),
        ("..", "'..'"),
        ("../etc/passwd", "'..'"),
        ("ns/../../secret", "'..'"),
        ("a..b", "'..'"),
        ("/etc/passwd", "absolute path"),
        ("/models/x", "absolute path"),
        ("~/models/x", "absolute path"),
        ("C:/models/x", "absolute path"),
        ("C:\\models\\x", "absolute path"),
        ("\\\\server\\share", "absolute path"),
        ("model.gguf", ".gguf"),
        ("dir/model.GGUF", ".gguf"),
        ("my model", "character ' '"),
        ("model\n", "character '\\n'"),
        ("ns\\model", "character '\\\\'"),
        ("model@sha256:abc", "character '@'"),
        ("mödel", "character 'ö'"),
        ("name;rm", "character ';'"),
        ("model:", "tag is empty"),
        (":tag", "name part is empty"),
        ("ns//model", "name part is empty"),
        ("ns/", "name part is empty"),
        ("a:b:c", "after one ':'"),
        ("a:b/c", "after one ':'"),
        ("a/b/c", "only hub names have three parts"),
        ("a/b/c/d", "too many '/'"),
        ("hf.co/repo", "hf.co/<org>/<repo>"),
        ("hf.co", "hf.co/<org>/<repo>"),
        ("hf.co/a/b/c", "hf.co/<org>/<repo>"),
        ("-model", "starts with a letter or digit"),
        (".hidden", "starts with a letter or digit"),
        ("model:-x", "starts with a letter or digit"),
        ("a" * 129, "longer than 128"),
    ],
)
def test_bad_names_are_refused_naming_the_rule(text: str, rule: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_name(text)
    assert rule in caught.value.message
    assert caught.value.param == "model"
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model.gguf", True),
        ("/abs/path/LFM2-1.2B-Q4_K_M.GGUF", True),
        ("./models/x.gguf", True),
        ("C:\\models\\x.gguf", True),
        ("llama3", False),
        ("hf.co/org/repo-GGUF", False),
        ("hf.co/org/repo-GGUF:Q4_K_M", False),
        ("model.gguf.part", False),
    ],
)
def test_is_gguf_path_is_a_suffix_check(text: str, expected: bool) -> None:
    assert is_gguf_path(text) is expected
