"""The one parser each: durations, host:port addresses, the developer role, and .gguf file names → model names."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.parsing import (
    Address,
    ParseError,
    chat_role,
    format_duration,
    model_name_for_file,
    parse_address,
    parse_duration,
)
from lmserve.store.names import parse_name


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("300", 300.0),
        (300, 300.0),
        (2.5, 2.5),
        ("0", 0.0),
        ("-1", -1.0),
        (-1, -1.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("2h45m30.5s", 9930.5),
        ("300ms", 0.3),
        ("1.5h", 5400.0),
        ("-1h", -3600.0),
        ("+10s", 10.0),
        ("100us", 1e-4),
        ("100µs", 1e-4),
        ("5ns", 5e-9),
        (" 5m ", 300.0),
    ],
)
def test_durations(value: str | float, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "m", "5x", "5 m", "m5", "1h-30m", "--5m", "inf", "nan", float("nan"),
                                   "forever", True])
def test_what_is_not_a_duration(value: object) -> None:
    with pytest.raises(ParseError, match="a duration like 5m"):
        parse_duration(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(300.0, "5m"), (5400.0, "1h30m"), (3600.0, "1h"), (61.0, "1m1s"), (0.5, "0.5s"), (0.0, "0s"), (None, "forever"),
     (-1.0, "forever")],
)
def test_format_duration_reads_back(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text
    if seconds is not None and seconds >= 0:
        assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("", Address()),
        ("127.0.0.1", Address("127.0.0.1")),
        ("0.0.0.0:8080", Address("0.0.0.0", 8080)),
        (":9000", Address("", 9000)),
        ("example.com", Address("example.com")),
        ("[::1]:8000", Address("::1", 8000)),
        ("[::1]", Address("::1")),
        ("::1", Address("::1")),
        ("fe80::1", Address("fe80::1")),
        ("http://example.com:1234/", Address("example.com", 1234, "http")),
        ("HTTPS://example.com", Address("example.com", None, "https")),
        ("http://host:1/prefix/", Address("host", 1, "http", "/prefix")),
        ("host:1/prefix", Address("host", 1, None, "/prefix")),
        ("http://[::1]:80", Address("::1", 80, "http")),
    ],
)
def test_addresses(text: str, address: Address) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["h:99999", "h:port", "h:-1", "[::1", "[::1]x", "ftp://h", "h:٣"])
def test_what_is_not_an_address(text: str) -> None:
    with pytest.raises(ParseError):
        parse_address(text)


def test_an_ipv6_host_is_bracketed_in_a_url() -> None:
    assert parse_address("::1").url_host == "[::1]"
    assert parse_address("h").url_host == "h"


@pytest.mark.parametrize(
    ("role", "seen"),
    [("developer", "system"), ("system", "system"), ("user", "user"), ("assistant", "assistant"), ("tool", "tool")],
)
def test_the_developer_role_is_the_system_role(role: str, seen: str) -> None:
    assert chat_role(role) == seen  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("SmolLM2-135M-Instruct-Q4_1.gguf", "SmolLM2-135M-Instruct-Q4_1:latest"),
        ("my model (v2).gguf", "my-model-v2:latest"),
        ("x.GGUF", "x:latest"),
        ("llama.3.1.gguf", "llama.3.1:latest"),
        ("a..b.gguf", "a.b:latest"),
        ("__hidden__.gguf", "hidden:latest"),
        ("-.-.gguf", "model-2c1ab64b:latest"),
        ("modèle-français.gguf", "modele-francais:latest"),
        ("Ünïcödé.gguf", "Unicode:latest"),
        ("\uff46\uff55\uff4c\uff4c.gguf", "full:latest"),  # fullwidth letters
        ("模型.gguf", "model-6c2a2b5b:latest"),
        ("a:b.gguf", "a-b:latest"),
        ("x" * 300 + ".gguf", "x" * 128 + ":latest"),
        ("a" * 127 + "-b.gguf", "a" * 127 + ":latest"),
    ],
)
def test_model_name_for_a_file(file: str, name: str) -> None:
    derived = model_name_for_file(Path("/models") / file)
    if name.startswith("model-"):
        assert derived.startswith("model-") and derived.endswith(":latest") and len(derived) == len(name)
    else:
        assert derived == name
    assert str(parse_name(derived)) == derived
    assert model_name_for_file(file) == derived  # a str path or a Path, same name


@pytest.mark.parametrize("file", ["模型.gguf", "модель.gguf", "-.-.gguf", "🦙 llama.gguf", "a b c.gguf", "ä.gguf"])
def test_every_file_name_gives_a_valid_name(file: str) -> None:
    name = model_name_for_file(file)
    assert str(parse_name(name)) == name


def test_file_names_that_lose_every_letter_still_differ() -> None:
    assert model_name_for_file("模型.gguf") != model_name_for_file("模式.gguf")
