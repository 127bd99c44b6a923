"""The client commands of `lmserve`: parsing, pure helpers, the REPL and each command through a fake client."""

from __future__ import annotations

import argparse
import base64
import io
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from lmserve import cli
from lmserve.cli import autostart, build_parser
from lmserve.cli.autostart import ensure_server
from lmserve.cli.client_command import dispatch
from lmserve.cli.formatting import format_table, human_duration, human_size, human_time, parse_time, processor, short_id
from lmserve.cli.models import rewrite_modelfile_paths
from lmserve.cli.repl import (
    Repl,
    extract_images,
    find_image_paths,
    format_stats,
    parse_set_parameter,
    read_multiline,
    render_show,
)
from lmserve.client import ClientError, ServerBusy, ServerUnreachable

PNG = b"\x89PNG\r\n\x1a\nfake"
DIGEST = "sha256:" + "0123456789ab" + "f" * 52


# ---- a fake client ---------------------------------------------------------------------------------------------------


class FakeClient:
    """Records calls; `chat` answers with `reply` in two chunks; `missing` models 404 on show."""

    base_url = "http://127.0.0.1:11434"

    def __init__(self, reply: str = "Hello there", missing: Sequence[str] = ()) -> None:
        self.reply, self.missing = reply, set(missing)
        self.calls: list[tuple[str, Any]] = []
        self.info: dict[str, Any] = {
            "modelfile": "FROM /m.gguf\nPARAMETER temperature 0.1\n",
            "parameters": 'temperature                    0.1\nstop                           "<|im_end|>"',
            "template": "{{ .Prompt }}", "system": "Be brief.", "license": "MIT\nsecond\nthird",
            "details": {"family": "llama", "parameter_size": "135M", "quantization_level": "Q8_0"},
            "model_info": {"general.architecture": "llama", "llama.context_length": 8192,
                           "llama.embedding_length": 576},
            "capabilities": ["completion"],
        }
        self.running = True
        self.answering: ClientError | None = None
        """What answers at the address when it is not lmserve (check_server raises it)."""

    def check_server(self) -> bool:
        if self.answering is not None:
            raise self.answering
        return self.running

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]], *, options: Mapping[str, Any] | None = None,
             stream: bool = True, keep_alive: str | int | None = None) -> Iterator[dict[str, Any]]:
        self.calls.append(("chat", {"model": model, "messages": [dict(m) for m in messages],
                                    "options": dict(options) if options else None}))
        if model in self.missing:
            raise ClientError(f"model '{model}' not found", 404)
        half = len(self.reply) // 2
        yield {"message": {"role": "assistant", "content": self.reply[:half]}, "done": False}
        yield {"message": {"role": "assistant", "content": self.reply[half:]}, "done": True, "eval_count": 2,
               "eval_duration": 1_000_000_000}

    def generate(self, model: str, prompt: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.calls.append(("generate", {"model": model, "prompt": prompt, **kwargs}))
        yield {"response": "", "done": True}

    def show(self, model: str, verbose: bool = False) -> dict[str, Any]:
        self.calls.append(("show", model))
        if model in self.missing:
            raise ClientError(f"model '{model}' not found", 404)
        return self.info

    def create(self, model: str, modelfile: str | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.calls.append(("create", {"model": model, "modelfile": modelfile, **kwargs}))
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    def pull(self, model: str) -> Iterator[dict[str, Any]]:
        self.calls.append(("pull", model))
        yield {"status": "pulling manifest"}
        if model.startswith("hf.co/broken"):
            raise ClientError("connection reset while downloading")
        if not model.startswith("hf.co/"):
            raise ClientError("file does not exist")  # mid-stream, no status
        yield {"status": "pulling 0123456789ab", "digest": DIGEST, "total": 1000, "completed": 1000}
        yield {"status": "success"}
        self.missing.discard(model)

    def tags(self) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {"models": [
            {"name": "smollm2:135m", "digest": DIGEST, "size": 270_000_000,
             "modified_at": (now - timedelta(minutes=3, seconds=5)).isoformat()},
            {"name": "a-much-longer-name:latest", "digest": "sha256:" + "9" * 64, "size": 4_700_000_000,
             "modified_at": (now - timedelta(days=3, minutes=1)).isoformat()},
        ]}

    def ps(self) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {"models": [{"name": "smollm2:135m", "digest": DIGEST, "size": 300_000_000, "size_vram": 0,
                            "expires_at": (now + timedelta(minutes=4, seconds=30)).isoformat()}]}

    def copy(self, src: str, dst: str) -> None:
        self.calls.append(("copy", (src, dst)))

    def delete(self, model: str) -> None:
        self.calls.append(("delete", model))
        if model in self.missing:
            raise ClientError(f"model '{model}' not found", 404)

    def stop(self, model: str) -> None:
        self.calls.append(("stop", model))


def run_cli(client: FakeClient, *argv: str) -> int:
    return dispatch(build_parser().parse_args(argv), client, start_server=False)  # type: ignore[arg-type]


class Stdin(io.StringIO):
    def __init__(self, text: str = "", tty: bool = False) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


# ---- argument parsing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "m"], {"command": "run", "model": "m", "prompt": [], "verbose": False}),
        (["run", "m", "why", "is", "the", "sky", "blue"], {"prompt": ["why", "is", "the", "sky", "blue"]}),
        (["run", "--verbose", "./x.gguf"], {"model": "./x.gguf", "verbose": True}),
        (["create", "mine", "-f", "dir/Modelfile", "-q", "q4_K_M"],
         {"model": "mine", "file": "dir/Modelfile", "quantize": "q4_K_M"}),
        (["create", "mine"], {"file": "Modelfile", "quantize": None}),
        (["list"], {"command": "list"}),
        (["ls"], {"command": "ls"}),
        (["rm", "a", "b:7b"], {"models": ["a", "b:7b"]}),
        (["show", "m"], {"model": "m", "section": None}),
        (["show", "m", "--modelfile"], {"section": "modelfile"}),
        (["show", "m", "--license"], {"section": "license"}),
        (["ps"], {"command": "ps"}),
        (["pull", "hf.co/org/repo:Q4_K_M"], {"model": "hf.co/org/repo:Q4_K_M"}),
        (["cp", "a", "b"], {"source": "a", "destination": "b"}),
        (["stop", "m"], {"model": "m"}),
        (["serve", "-m", "/x.gguf", "--port", "9000", "-np", "2"], {"model_flag": "/x.gguf", "port": "9000",
                                                                    "parallel": "2"}),
    ],
)
def test_parse_commands(argv: list[str], expected: dict[str, object]) -> None:
    args = vars(build_parser().parse_args(argv))
    assert {key: args[key] for key in expected} == expected


@pytest.mark.parametrize(
    "argv", [[], ["run"], ["rm"], ["cp", "a"], ["show", "m", "--modelfile", "--template"], ["bogus"], ["pull"]],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert "usage: lmserve" in capsys.readouterr().err


# ---- pure helpers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1 KB"), (1500, "1.5 KB"), (270_000_000, "270 MB"),
     (1_234_567_890, "1.2 GB"), (4_700_000_000, "4.7 GB"), (12_300_000_000, "12 GB"), (2e12, "2 TB"), (None, "0 B")],
)
def test_human_size(size: object, text: str) -> None:
    assert human_size(size) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.5, "Less than a second"), (1, "1 second"), (42, "42 seconds"), (61, "About a minute"),
     (180, "3 minutes"), (3600, "About an hour"), (5 * 3600, "5 hours"), (3 * 86400, "3 days"),
     (20 * 86400, "2 weeks"), (90 * 86400, "3 months"), (800 * 86400, "2 years")],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_human_time_and_parse_time() -> None:
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    assert human_time(now - timedelta(minutes=3), now) == "3 minutes ago"
    assert human_time(now + timedelta(minutes=4, seconds=30), now) == "4 minutes from now"
    assert human_time(now + timedelta(days=365 * 100), now) == "Forever"
    assert human_time(None, now, zero="Never") == "Never"
    assert parse_time("2024-05-01T11:57:00.123456789Z") == datetime(2024, 5, 1, 11, 57, 0, 123456, tzinfo=UTC)
    assert parse_time("2024-05-01T04:57:00-07:00") == now - timedelta(minutes=3)
    assert parse_time("2024-05-01T11:57:00") == now - timedelta(minutes=3)
    assert parse_time("yesterday") is None
    assert parse_time(None) is None


def test_ids_processor_and_tables() -> None:
    assert short_id(DIGEST) == "0123456789ab"
    assert short_id(None) == ""
    assert [processor(100, 0), processor(100, 100), processor(100, 70), processor(None, None)] == [
        "100% CPU", "100% GPU", "30%/70% CPU/GPU", "100% CPU"]
    assert format_table([["NAME", "ID"], ["long-name:latest", "abc"]]) == (
        "NAME                ID\nlong-name:latest    abc")


@pytest.mark.parametrize("file", ["SmolLM2-135M-Instruct-Q8_0.gguf", "my model (1).gguf", "_x.gguf", "+++.gguf",
                                  "modèle.gguf", "模型.gguf"])
def test_run_names_a_file_as_serve_does(file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve FILE` names it with the same `model_name_for_file` (tests/test_server.py checks that side)."""
    from lmserve.parsing import model_name_for_file

    monkeypatch.setattr("sys.stdin", Stdin(tty=True))
    (tmp_path / file).write_bytes(b"GGUF")
    client = FakeClient()
    assert run_cli(client, "run", str(tmp_path / file), "hi") == 0
    assert client.calls[0][1]["model"] == model_name_for_file(tmp_path / file)


def test_rewrite_modelfile_paths(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "lora.gguf").write_bytes(b"GGUF")
    (tmp_path / "with space.gguf").write_bytes(b"GGUF")
    text = ("# FROM ./weights/model.gguf stays a comment\n"
            "FROM ./weights/model.gguf\n"
            "from   lora.gguf  \r\n"
            'ADAPTER "with space.gguf"\n'
            "ADAPTER ./missing.gguf\n"
            "FROM llama3.2\n"
            "FROM /abs/elsewhere.gguf\n"
            'TEMPLATE """\nFROM ./weights/model.gguf\n"""\n'
            "FROM weights/model.gguf")
    rewritten = rewrite_modelfile_paths(text, tmp_path).split("\n")
    weights = str((tmp_path / "weights" / "model.gguf").resolve())
    assert rewritten == [
        "# FROM ./weights/model.gguf stays a comment",
        f"FROM {weights}",
        f"from   {(tmp_path / 'lora.gguf').resolve()}  \r",
        f'ADAPTER "{(tmp_path / "with space.gguf").resolve()}"',
        "ADAPTER ./missing.gguf",
        "FROM llama3.2",
        "FROM /abs/elsewhere.gguf",
        'TEMPLATE """', "FROM ./weights/model.gguf", '"""',
        f"FROM {weights}",
    ]


@pytest.fixture
def images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("cat.png", "dog.JPG", "my photo.webp", "notes.txt"):
        (tmp_path / name).write_bytes(PNG)
    return tmp_path


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("what is in cat.png?", ["cat.png"]),
        ("describe ./cat.png.", ["./cat.png"]),
        ("compare cat.png and dog.JPG", ["cat.png", "dog.JPG"]),
        ("look at 'my photo.webp' please", ["'my photo.webp'"]),
        ('look at "my photo.webp"', ['"my photo.webp"']),
        (r"look at my\ photo.webp", [r"my\ photo.webp"]),
        ("missing.png and notes.txt are not images here", []),
        ("catXpng", []),
    ],
)
def test_find_image_paths(images: Path, text: str, found: list[str]) -> None:
    assert [written for written, _ in find_image_paths(text)] == found


def test_image_paths_absolute_and_extracted(images: Path) -> None:
    absolute = str(images / "cat.png")
    text, paths = extract_images(f"what is in {absolute} ?")
    assert (text, paths) == ("what is in ?", [Path(absolute)])


def test_read_multiline() -> None:
    more = iter(["first line", "second line", 'end"""'])
    assert read_multiline('"""', lambda prompt: next(more)) == "first line\nsecond line\nend"
    more = iter(["b", '"""'])
    assert read_multiline('"""a', lambda prompt: next(more)) == "a\nb"
    assert read_multiline('"""one line"""', lambda prompt: pytest.fail("read more")) == "one line"


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["temperature", "0.2"], ("temperature", 0.2)), (["top_k", "40"], ("top_k", 40)),
     (["num_ctx", "2048"], ("num_ctx", 2048)), (["use_mmap", "false"], ("use_mmap", False)),
     (["temperature", "1"], ("temperature", 1.0)), (["stop", "<|im_end|>", "###"], ("stop", ["<|im_end|>", "###"]))],
)
def test_parse_set_parameter(args: list[str], expected: tuple[str, object]) -> None:
    name, value = parse_set_parameter(args)
    assert (name, value) == expected
    assert type(value) is type(expected[1])


@pytest.mark.parametrize("args", [[], ["temperature"], ["top_k", "many"], ["bogus", "1"]])
def test_parse_set_parameter_errors(args: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_set_parameter(args)


def test_render_show() -> None:
    info = FakeClient().info
    summary = render_show(info)
    for expected in ("  Model", "architecture        llama", "parameters          135M", "context length      8192",
                     "quantization        Q8_0", "  Capabilities\n    completion", 'stop           "<|im_end|>"',
                     "  System\n    Be brief.", "  License\n    MIT\n    second"):
        assert expected in summary
    assert "third" not in summary
    assert render_show(info, "modelfile") == "FROM /m.gguf\nPARAMETER temperature 0.1"
    assert render_show(info, "parameters").splitlines()[0].split() == ["temperature", "0.1"]
    assert render_show({"parameters": {"stop": ["a", "b"], "top_k": 4}}, "parameters").split() == [
        "stop", '"a"', "stop", '"b"', "top_k", "4"]
    assert render_show({}, "license") == ""


def test_format_stats() -> None:
    stats = format_stats({"total_duration": 2_000_000_000, "eval_count": 10, "eval_duration": 500_000_000})
    assert "total duration:       2.000s" in stats
    assert "eval rate:            20.00 tokens/s" in stats


# ---- the REPL --------------------------------------------------------------------------------------------------------


def repl_session(client: FakeClient, *lines: str) -> tuple[Repl, str, str, int]:
    feed = iter(lines)
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    repl = Repl(client, "smollm2", read=read, out=out, err=err)
    code = repl.loop()
    return repl, out.getvalue(), err.getvalue(), code


def chats(client: FakeClient) -> list[dict[str, Any]]:
    return [call for name, call in client.calls if name == "chat"]


def test_repl_keeps_history_and_exits_on_bye() -> None:
    client = FakeClient()
    repl, out, _, code = repl_session(client, "Hi", "", "And again?", "/bye", "never read")
    assert code == 0
    assert out == "Hello there\n\nHello there\n\n"
    assert chats(client)[1]["messages"] == [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello there"},
                                            {"role": "user", "content": "And again?"}]
    assert len(repl.messages) == 4


def test_repl_exits_on_ctrl_d() -> None:
    _, out, _, code = repl_session(FakeClient())
    assert (out, code) == ("\n", 0)


def test_repl_clear_help_and_unknown_command() -> None:
    client = FakeClient()
    _, out, _, _ = repl_session(client, "Hi", "/clear", "/?", "/help", "/nope", "Fresh")
    assert "Cleared session context" in out
    assert out.count("Available commands:") == 2
    assert "Unknown command '/nope'. Type /? for help" in out
    assert chats(client)[-1]["messages"] == [{"role": "user", "content": "Fresh"}]


def test_repl_set_parameter_and_system() -> None:
    client = FakeClient()
    _, out, _, _ = repl_session(client, "/set parameter temperature 0.3", "/set parameter stop a b",
                                "/set parameter top_k lots", "/set system You are terse.", "Hi",
                                "/unset parameter stop", "Again")
    assert "Set parameter 'temperature' to '0.3'" in out
    assert "Couldn't set parameter" in out
    first, second = chats(client)
    assert first["options"] == {"temperature": 0.3, "stop": ["a", "b"]}
    assert first["messages"][0] == {"role": "system", "content": "You are terse."}
    assert second["options"] == {"temperature": 0.3}


def test_repl_multiline_message() -> None:
    client = FakeClient()
    repl_session(client, '"""', "line one", "line two", '"""')
    assert chats(client)[0]["messages"] == [{"role": "user", "content": "line one\nline two"}]


def test_repl_show(images: Path) -> None:
    client = FakeClient()
    _, out, _, _ = repl_session(client, "/show info", "/show modelfile", "/show template", "/show nonsense")
    assert "architecture        llama" in out
    assert "FROM /m.gguf\nPARAMETER temperature 0.1\n" in out
    assert "{{ .Prompt }}\n" in out
    assert "Usage: /show info|modelfile|parameters|template|system|license" in out


@pytest.mark.parametrize(
    ("model_has", "lines", "shown"),
    [
        ({}, ["/show parameters", "/show system"],
         ["No parameters was specified for this model.", "No system was specified for this model."]),
        ({}, ["/set parameter temperature 0.7", "/set system Talk like a pirate.", "/show parameters", "/show system"],
         ["temperature 0.7", "Talk like a pirate."]),
        ({"parameters": 'temperature 0.1\nstop "<|im_end|>"', "system": "Be brief."},
         ["/set parameter temperature 0.7", "/set parameter stop a b", "/show parameters"],
         ["temperature 0.7", 'stop "a"', 'stop "b"']),
        ({"parameters": 'temperature 0.1\nstop "<|im_end|>"', "system": "Be brief."},
         ["/set parameter top_k 5", "/set system Be long.", "/show"],
         ["Parameters", "temperature 0.1", 'stop "<|im_end|>"', "top_k 5", "System", "Be long."]),
        ({"parameters": "temperature 0.1", "system": "Be brief."},
         ["/set parameter temperature 0.7", "/unset parameter temperature", "/unset system", "/show parameters",
          "/show system"],
         ["temperature 0.1", "Be brief."]),
    ],
)  # fmt: skip
def test_repl_show_reflects_the_session(model_has: dict[str, str], lines: list[str], shown: list[str]) -> None:
    client = FakeClient()
    for section in ("parameters", "system"):
        client.info.pop(section)
    client.info.update(model_has)
    _, out, _, _ = repl_session(client, *lines)
    printed = [" ".join(line.split()) for line in out.splitlines() if not line.startswith(("Set ", "Unset "))]
    printed = [line for line in printed if line]
    assert any(printed[i : i + len(shown)] == shown for i in range(len(printed))), printed


def test_repl_images(images: Path) -> None:
    client = FakeClient()
    encoded = base64.b64encode(PNG).decode()
    _, out, _, _ = repl_session(client, "/image cat.png", "What is this?", "/image ./dog.JPG and this?",
                                "describe ./cat.png please", f"{images / 'cat.png'} what?", "/image nothing.png")
    sent = [call["messages"][-1] for call in chats(client)]
    assert sent[0] == {"role": "user", "content": "What is this?", "images": [encoded]}
    assert sent[1] == {"role": "user", "content": "and this?", "images": [encoded]}
    assert sent[2] == {"role": "user", "content": "describe please", "images": [encoded]}
    assert sent[3] == {"role": "user", "content": "what?", "images": [encoded]}
    assert "Added image 'cat.png'" in out
    assert "Usage: /image PATH" in out
    assert len(sent) == 4


def test_repl_audio(images: Path) -> None:
    clip = b"RIFF\0\0\0\0WAVEfmt "
    (images / "note.wav").write_bytes(clip)
    client = FakeClient()
    encoded = base64.b64encode(clip).decode()
    _, out, _, _ = repl_session(client, "/audio note.wav", "What is said?", "transcribe ./note.wav please",
                                "/audio cat.png", "/audio missing.mp3")
    sent = [call["messages"][-1] for call in chats(client)]
    assert sent == [{"role": "user", "content": "What is said?", "images": [encoded]},
                    {"role": "user", "content": "transcribe please", "images": [encoded]}]
    assert out.count("Added audio 'note.wav'") + out.count("Added audio 'note.wav'".replace("note", "./note")) == 2
    assert out.count("Usage: /audio PATH [QUESTION] (PATH must be an existing .wav/.mp3/.flac/.ogg file)") == 2


def test_repl_reports_errors_and_drops_the_failed_turn() -> None:
    client = FakeClient(missing=["gone"])
    repl, out, err, _ = repl_session(client, "/load gone", "/load", "/load other", "Hi")
    assert "Error: model 'gone' not found" in err
    assert "Usage: /load MODEL" in out
    assert repl.model == "other"
    assert chats(client)[0]["model"] == "other"
    err_stream = io.StringIO()
    repl = Repl(client, "gone", read=input, out=io.StringIO(), err=err_stream)
    repl.handle("Hi")
    assert err_stream.getvalue() == "Error: model 'gone' not found\n"
    assert repl.messages == []


# ---- commands through a fake client --------------------------------------------------------------------------------


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(FakeClient(), "ls") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert lines[1].split() == ["smollm2:135m", "0123456789ab", "270", "MB", "3", "minutes", "ago"]
    assert lines[2].split()[2:] == ["4.7", "GB", "3", "days", "ago"]
    assert lines[0].index("ID") == lines[1].index("0123456789ab")


def test_ps(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(FakeClient(), "ps") == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "UNTIL"]
    assert row.split() == ["smollm2:135m", "0123456789ab", "300", "MB", "100%", "CPU", "4", "minutes", "from", "now"]


def test_show_rm_cp_stop(capsys: pytest.CaptureFixture[str]) -> None:
    client = FakeClient()
    assert run_cli(client, "show", "m", "--system") == 0
    assert run_cli(client, "rm", "a", "b") == 0
    assert run_cli(client, "cp", "a", "c") == 0
    assert run_cli(client, "stop", "a") == 0
    assert capsys.readouterr().out == "Be brief.\ndeleted 'a'\ndeleted 'b'\ncopied 'a' to 'c'\n"
    assert client.calls == [("show", "m"), ("delete", "a"), ("delete", "b"), ("copy", ("a", "c")), ("stop", "a")]


def test_errors_print_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(FakeClient(missing=["x"]), "rm", "x") == 1
    assert capsys.readouterr().err == "Error: model 'x' not found\n"


def test_create_sends_the_modelfile_with_absolute_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "Modelfile").write_text("FROM ./model.gguf\nPARAMETER temperature 0.1\n")
    client = FakeClient()
    assert run_cli(client, "create", "mine", "-f", str(tmp_path / "Modelfile"), "-q", "q8_0") == 0
    assert client.calls == [("create", {"model": "mine", "quantize": "q8_0",
                                        "modelfile": f"FROM {(tmp_path / 'model.gguf').resolve()}\n"
                                                     "PARAMETER temperature 0.1\n"})]
    assert "writing manifest" in capsys.readouterr().err
    assert run_cli(client, "create", "x", "-f", str(tmp_path / "nope")) == 1
    assert "could not read Modelfile" in capsys.readouterr().err


def test_pull_shows_status_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(FakeClient(), "pull", "hf.co/org/repo:Q8_0") == 0
    err = capsys.readouterr().err
    assert "pulling manifest" in err
    assert "success" in err


def test_run_one_shot(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", Stdin(tty=True))
    client = FakeClient()
    assert run_cli(client, "run", "smollm2", "Say", "hi") == 0
    assert capsys.readouterr().out == "Hello there\n"
    assert chats(client) == [{"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}],
                              "options": None}]


def test_run_reads_piped_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    client = FakeClient()
    monkeypatch.setattr("sys.stdin", Stdin("some text\n"))
    assert run_cli(client, "run", "m", "Summarize:") == 0
    monkeypatch.setattr("sys.stdin", Stdin("only stdin"))
    assert run_cli(client, "run", "m") == 0
    assert [c["messages"][0]["content"] for c in chats(client)] == ["Summarize:\n\nsome text\n", "only stdin"]
    assert capsys.readouterr().out == "Hello there\nHello there\n"


def test_run_interactive_loads_then_loops(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", Stdin(tty=True))
    lines = iter(["Hi", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    client = FakeClient()
    assert run_cli(client, "run", "m") == 0
    assert [name for name, _ in client.calls] == ["show", "generate", "chat"]
    assert client.calls[1][1] == {"model": "m", "prompt": "", "stream": False}
    assert capsys.readouterr().out == "Hello there\n\n"


def test_run_gguf_creates_a_model_named_after_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", Stdin(tty=True))
    (tmp_path / "Tiny-Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    client = FakeClient()
    assert run_cli(client, "run", "Tiny-Q8_0.gguf", "hi") == 0
    assert client.calls[0] == ("create", {"model": "Tiny-Q8_0:latest", "modelfile": None,
                                          "from_": str((tmp_path / "Tiny-Q8_0.gguf").resolve())})
    assert chats(client)[0]["model"] == "Tiny-Q8_0:latest"
    assert run_cli(client, "run", "missing.gguf", "hi") == 1


def test_run_pulls_a_missing_model_or_reports_it(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", Stdin(tty=True))
    client = FakeClient(missing=["x", "hf.co/o/r"])
    assert run_cli(client, "run", "x", "hi") == 1
    assert capsys.readouterr().err.splitlines()[-1] == "Error: model 'x' not found"
    assert ("pull", "x") in client.calls
    client.missing = {"hf.co/o/r", "hf.co/broken/r"}
    assert run_cli(client, "run", "hf.co/o/r", "hi") == 0
    assert ("pull", "hf.co/o/r") in client.calls
    assert run_cli(client, "run", "hf.co/broken/r", "hi") == 1
    assert capsys.readouterr().err.splitlines()[-1] == "Error: connection reset while downloading"


# ---- starting a server ---------------------------------------------------------------------------------------------


class FakeProcess:
    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_ensure_server_does_nothing_when_running() -> None:
    ensure_server(FakeClient(), spawn=lambda url, log: pytest.fail("spawned"))  # type: ignore[arg-type]


def test_ensure_server_starts_one_and_waits(capsys: pytest.CaptureFixture[str]) -> None:
    client = FakeClient()
    client.running = False
    spawned: list[str] = []
    sleeps: list[float] = []

    def spawn(url: str, log: Path) -> FakeProcess:
        spawned.append(url)
        return FakeProcess()

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        client.running = len(sleeps) >= 3

    ensure_server(client, spawn=spawn, sleep=sleep)  # type: ignore[arg-type]
    assert spawned == ["http://127.0.0.1:11434"]
    assert len(sleeps) == 3
    assert "starting it in the background" in capsys.readouterr().err


def test_ensure_server_failures() -> None:
    client = FakeClient()
    client.running = False
    with pytest.raises(ClientError, match="exited with code 1"):
        ensure_server(client, spawn=lambda url, log: FakeProcess(1), sleep=lambda s: None)  # type: ignore[arg-type]
    ticks = iter(range(100))
    with pytest.raises(ClientError, match="did not answer"):
        ensure_server(client, spawn=lambda url, log: FakeProcess(), sleep=lambda s: None,  # type: ignore[arg-type]
                      clock=lambda: float(next(ticks)), wait_s=5)
    client.base_url = "http://10.1.2.3:11434"
    with pytest.raises(ServerUnreachable):
        ensure_server(client, spawn=lambda url, log: pytest.fail("spawned"))  # type: ignore[arg-type]


def test_ensure_server_waits_for_a_server_that_accepts_but_has_not_answered_yet() -> None:
    """A ReadTimeout of /api/version is a server still starting or busy: waited for, never a second one started."""
    client = FakeClient()
    client.answering = ServerBusy(client.base_url)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        client.answering = None if len(sleeps) >= 2 else client.answering

    ensure_server(client, spawn=lambda url, log: pytest.fail("spawned"), sleep=sleep)  # type: ignore[arg-type]
    assert len(sleeps) == 2
    starting = FakeClient()
    starting.running = False  # nothing answers: one is started, then it is busy loading before it answers
    spawned: list[str] = []

    def spawn(url: str, log: Path) -> FakeProcess:
        spawned.append(url)
        starting.answering = ServerBusy(url)
        return FakeProcess()

    def wait(seconds: float) -> None:
        sleeps.append(seconds)
        starting.answering, starting.running = (None, True) if len(sleeps) >= 5 else (starting.answering, False)

    ensure_server(starting, spawn=spawn, sleep=wait)  # type: ignore[arg-type]
    assert spawned == [starting.base_url] and len(sleeps) == 5


def test_main_reports_a_server_that_does_not_start(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setenv("LMSERVE_HOST", "127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("LMSERVE_MODELS", str(tmp_path))
    monkeypatch.setattr(autostart, "_spawn_server", lambda url, log: FakeProcess(3))
    assert cli.main(["list"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"Error: the server exited with code 3 while starting; see {tmp_path / 'server.log'}"


@pytest.mark.parametrize(
    ("env", "log"),
    [
        ({}, Path.home() / ".lmserve" / "models" / "server.log"),
        ({"LMSERVE_MODELS": ""}, Path.home() / ".lmserve" / "models" / "server.log"),
        ({"LMSERVE_MODELS": "/srv/models"}, Path("/srv/models/server.log")),
        ({"LMSERVE_MODELS": "~/m"}, Path.home() / "m" / "server.log"),
    ],
)
def test_a_started_server_logs_into_its_model_store(env: dict[str, str], log: Path) -> None:
    """The server the CLI starts inherits LMSERVE_MODELS: its log is server.log in that store."""
    assert autostart.server_log(env) == log
    logs: list[Path] = []

    def spawn(url: str, path: Path) -> FakeProcess:
        logs.append(path)
        return FakeProcess(3)

    client = FakeClient()
    client.running = False
    with pytest.raises(ClientError, match=f"see {re.escape(str(log))}$"):
        ensure_server(client, spawn=spawn, sleep=lambda s: None, env=env)  # type: ignore[arg-type]
    assert logs == [log]


def test_a_log_that_cannot_be_written_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    client = FakeClient()
    client.running = False
    with pytest.raises(ClientError, match=r"^could not start the server \(log .*/file/server.log\): "):
        ensure_server(client, sleep=lambda s: None, env={"LMSERVE_MODELS": str(tmp_path / "file")})  # type: ignore[arg-type]


@pytest.mark.parametrize(("error", "status"), [(BrokenPipeError(32, "Broken pipe"), 141), (KeyboardInterrupt(), 130)])
def test_a_closed_stdout_or_ctrl_c_ends_without_a_traceback(error: BaseException, status: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`lmserve run … | head` ends with 128 + SIGPIPE as Unix tools do (tests/test_cli_e2e.py: a real pipe)."""

    def interrupted(argv: Sequence[str] | None) -> int:
        raise error

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["list"]) == status


def test_every_command_is_listed() -> None:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"serve", "run", "create", "list", "ls", "rm", "show", "ps", "pull", "cp", "stop",
                                       "batch", "sign"}


# ---- the server's address, its API key, and what answers there ------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [ClientError("the server at http://127.0.0.1:11434 requires an API key: set LMSERVE_API_KEY", 401),
     ClientError("something that is not lmserve answers at http://127.0.0.1:11434: GET /api/version gave 404", 404)],
)
def test_no_server_is_started_when_anything_answers(answer: ClientError, capsys: pytest.CaptureFixture[str]) -> None:
    client = FakeClient()
    client.answering = answer
    assert dispatch(build_parser().parse_args(["list"]), client) == 1  # type: ignore[arg-type]
    assert capsys.readouterr().err == f"Error: {answer.message}\n"
    with pytest.raises(ClientError):
        ensure_server(client, spawn=lambda url, log: pytest.fail("spawned"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "url"),
    [({"LMSERVE_PORT": "9"}, "http://127.0.0.1:9"), ({"LMSERVE_HOST": "127.0.0.1:9", "LMSERVE_PORT": "7"},
                                                     "http://127.0.0.1:9")],
)
def test_the_cli_finds_the_server_at_lmserve_port(env: dict[str, str], url: str, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    for name in ("LMSERVE_HOST", "LMSERVE_PORT", "LMSERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spawned: list[str] = []
    monkeypatch.setenv("LMSERVE_MODELS", str(tmp_path))

    def spawn(url: str, log: Path) -> FakeProcess:
        spawned.append(url)
        return FakeProcess(3)

    monkeypatch.setattr(autostart, "_spawn_server", spawn)
    assert cli.main(["ps"]) == 1
    assert spawned == [url]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from lmserve import __version__

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert (exit_.value.code, capsys.readouterr().out) == (0, f"lmserve {__version__}\n")


@pytest.mark.parametrize("command", ["run", "create", "list", "ls", "rm", "show", "ps", "pull", "cp", "stop"])
def test_client_help_names_the_address_and_key_variables(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("LMSERVE_HOST", "LMSERVE_PORT", "LMSERVE_API_KEY"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--port", "99999"], "lmserve: --port must be at most 65535, got 99999\n"),
     (["--port", "x"], "lmserve: --port must be an integer, got 'x'\n"),
     (["-c", "0"], "lmserve: --ctx-size must be at least 1, got 0\n")],
)
def test_bad_serve_values_are_one_line_and_exit_2(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", *argv]) == 2
    assert capsys.readouterr().err == message
