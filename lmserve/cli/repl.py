'''The interactive side of `lmserve run`: the `>>>` loop, one-shot replies, and the text `show` prints.

The loop talks to the server only through a client object (`ReplClient`: `chat` and `show`), reads lines with
a `read(prompt)` function (builtin `input` in a terminal) and writes to text streams, so tests drive it with
lists of lines and StringIO. Conversation history is kept as chat messages and sent whole with each turn.
'''

from __future__ import annotations

import base64
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from lmserve.client import ClientError

Json = dict[str, Any]
Message = dict[str, Any]
SHOW_SECTIONS = ("info", "modelfile", "parameters", "template", "system", "license")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac", ".ogg")
"""Audio clips travel in the native `images` field too (the server tells them apart by their content)."""
_TRIPLE = '"""'
_EXT = r"\.(?:png|jpe?g|webp|gif|wav|mp3|flac|ogg)"
_IMAGE_PATH = re.compile(
    rf"""(?P<q>['"])(?P<quoted>[^'"\n]+?{_EXT})(?P=q)"""
    rf"""|(?<![^\s(\[])(?P<bare>(?:\\\ |[^\s'"\\])+?{_EXT})(?=$|[\s,;:!?.)\]])""",
    re.IGNORECASE,
)

HELP = '''Available commands:
  /set parameter NAME VALUE   Set a sampling or load option sent with every message (/set parameter temperature 0.2)
  /set system TEXT            Set the system message
  /set verbose | quiet        Show or hide timing statistics after each reply
  /unset parameter NAME       Forget a parameter
  /show SECTION               Show model information: info, modelfile, parameters, template, system or license
  /load MODEL                 Switch to another model, keeping the conversation
  /image PATH [QUESTION]      Attach an image to the next message (or ask QUESTION about it now)
  /audio PATH [QUESTION]      Attach an audio clip (.wav, .mp3, .flac, .ogg) the same way
  /clear                      Clear the conversation
  /bye                        Exit (Ctrl-D works too)
  /?, /help                   Show this help

Use """ to begin and end a multi-line message.
A path to a .png, .jpg, .jpeg, .webp or .gif file written in a message attaches that image; a path to a .wav,
.mp3, .flac or .ogg file attaches that audio clip.
'''


class ReplClient(Protocol):
    """What the loop needs from `lmserve.client.Client`."""

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]], *, options: Mapping[str, Any] | None = None,
             stream: bool = True, keep_alive: str | int | None = None) -> Iterator[Json]: ...

    def show(self, model: str, verbose: bool = False) -> Json: ...


# ---- pure helpers --------------------------------------------------------------------------------------------------


def read_multiline(first: str, read: Callable[[str], str]) -> str:
    '''`"""` opens a message that runs until a line ending with `"""`; `read("... ")` supplies the next lines.'''
    body = first.lstrip()[len(_TRIPLE):]
    if body.rstrip().endswith(_TRIPLE):
        return body.rstrip()[: -len(_TRIPLE)]
    parts = [body] if body.strip() else []
    while True:
        line = read("... ")
        if line.rstrip().endswith(_TRIPLE):
            last = line.rstrip()[: -len(_TRIPLE)]
            if last:
                parts.append(last)
            return "\n".join(parts)
        parts.append(line)


def find_image_paths(text: str) -> list[tuple[str, Path]]:
    """Image paths written in `text` that name existing files: (text as written, path). Quotes and `\\ ` allowed."""
    found: list[tuple[str, Path]] = []
    for match in _IMAGE_PATH.finditer(text):
        written = match.group(0)
        raw = match.group("quoted") or match.group("bare").replace("\\ ", " ")
        path = Path(raw).expanduser()
        if path.is_file():
            found.append((written, path))
    return found


def extract_images(text: str) -> tuple[str, list[Path]]:
    """Remove the existing image paths from `text`; return the rest (tidied when paths were found) and the paths."""
    found = find_image_paths(text)
    if not found:
        return text, []
    for written, _ in found:
        text = text.replace(written, "", 1)
    return re.sub(r"[ \t]{2,}", " ", text).strip(), [path for _, path in found]


def encode_image(path: Path) -> str:
    """An image (or audio) file as base64 text, as the native API takes it (no data: prefix)."""
    try:
        return base64.b64encode(path.read_bytes()).decode("ascii")
    except OSError as exc:
        raise ClientError(f"could not read {media_kind(path)} {str(path)!r}: {exc.strerror}") from None


def media_kind(path: Path) -> str:
    return "audio" if path.suffix.lower() in AUDIO_SUFFIXES else "image"


def user_message(text: str, images: Sequence[str] = ()) -> tuple[Message, list[Path]]:
    """A chat message from typed text: image paths in it are attached (base64) after `images`, and returned."""
    text, paths = extract_images(text)
    encoded = [*images, *(encode_image(path) for path in paths)]
    message: Message = {"role": "user", "content": text}
    if encoded:
        message["images"] = encoded
    return message, paths


def parse_set_parameter(args: Sequence[str]) -> tuple[str, object]:
    """`NAME VALUE…` → (name, typed value) with the Modelfile's types; `stop` takes one or more values as a list."""
    from lmserve.options import parse_parameter

    if len(args) < 2:
        raise ValueError("usage: /set parameter NAME VALUE")
    name, values = args[0], list(args[1:])
    try:
        if name == "stop":
            return name, [str(parse_parameter(name, value)) for value in values]
        return name, parse_parameter(name, " ".join(values))
    except Exception as exc:  # InvalidRequest: unknown name or a value of the wrong type
        raise ValueError(getattr(exc, "message", str(exc))) from None


def stream_reply(chunks: Iterator[Json], out: TextIO) -> tuple[str, Json]:
    """Print each chunk's text as it comes; return the whole reply and the final chunk (with the counters)."""
    pieces: list[str] = []
    final: Json = {}
    for chunk in chunks:
        message = chunk.get("message")
        piece = message.get("content", "") if isinstance(message, dict) else chunk.get("response", "")
        if piece:
            pieces.append(piece)
            out.write(piece)
            out.flush()
        if chunk.get("done"):
            final = chunk
    return "".join(pieces), final


def format_stats(final: Mapping[str, Any]) -> str:
    """The timing lines `--verbose` prints after a reply (durations arrive in nanoseconds)."""
    lines = []
    for label, key in (("total duration", "total_duration"), ("load duration", "load_duration")):
        if key in final:
            lines.append(f"{label + ':':<22}{final[key] / 1e9:.3f}s")
    for label, count, duration in (("prompt eval", "prompt_eval_count", "prompt_eval_duration"),
                                   ("eval", "eval_count", "eval_duration")):
        if count in final:
            lines.append(f"{label + ' count:':<22}{final[count]} token(s)")
        if final.get(duration):
            lines.append(f"{label + ' duration:':<22}{final[duration] / 1e9:.3f}s")
            lines.append(f"{label + ' rate:':<22}{final.get(count, 0) / (final[duration] / 1e9):.2f} tokens/s")
    return "\n".join(lines)


# ---- `show` ----------------------------------------------------------------------------------------------------------


def render_show(info: Mapping[str, Any], section: str = "info") -> str:
    """What `lmserve show` and `/show SECTION` print."""
    if section == "info":
        return _summary(info)
    if section == "parameters":
        return "\n".join(f"{name:<24}{value}" for name, value in _parameters(info.get("parameters")))
    value = info.get(section)
    if isinstance(value, list):
        return "\n\n".join(str(item) for item in value)
    return "" if value is None else str(value).rstrip("\n")


def with_session(info: Mapping[str, Any], options: Mapping[str, object], system: str | None) -> dict[str, Any]:
    """`show`'s answer as the session sees the model: its `/set system` and `/set parameter` values over the
    model's own (a parameter set in the session replaces every value the model has for that name)."""
    merged = dict(info)
    if system is not None:
        merged["system"] = system
    if options:
        own = [(name, value) for name, value in _parameters(info.get("parameters")) if name not in options]
        merged["parameters"] = "\n".join(f"{name} {value}" for name, value in [*own, *_parameters(options)])
    return merged


def _summary(info: Mapping[str, Any]) -> str:
    details = info.get("details") or {}
    model_info = info.get("model_info") or {}
    arch = str(model_info.get("general.architecture") or details.get("family") or "")
    rows = [("architecture", arch),
            ("parameters", details.get("parameter_size") or _human_count(model_info.get("general.parameter_count"))),
            ("context length", model_info.get(f"{arch}.context_length")),
            ("embedding length", model_info.get(f"{arch}.embedding_length")),
            ("quantization", details.get("quantization_level"))]
    sections = [("Model", [f"{k:<20}{v}" for k, v in rows if v not in (None, "")])]
    sections.append(("Capabilities", [str(c) for c in info.get("capabilities") or []]))
    sections.append(("Parameters", [f"{k:<15}{v}" for k, v in _parameters(info.get("parameters"))]))
    signature = info.get("signature") or {}
    sections.append(("Signature", [f"{k.replace('_', ' '):<15}{v}" for k, v in signature.items()]))
    for title in ("system", "license"):
        text = render_show(info, title).strip()
        sections.append((title.capitalize(), text.splitlines()[:2]))
    return "\n\n".join(f"  {title}\n" + "\n".join(f"    {line}" for line in lines)
                       for title, lines in sections if lines)


def _parameters(value: object) -> list[tuple[str, str]]:
    """Parameters as the server sends them: the local runner's text (`name   value` lines) or an object."""
    if isinstance(value, Mapping):
        pairs: list[tuple[str, str]] = []
        for name, item in value.items():
            items = item if isinstance(item, list) else [item]
            pairs += [(str(name), f'"{x}"' if isinstance(x, str) else str(x).lower() if isinstance(x, bool)
                       else str(x)) for x in items]
        return pairs
    if isinstance(value, str):
        return [(parts[0], parts[1].strip() if len(parts) > 1 else "")
                for parts in (line.split(None, 1) for line in value.splitlines() if line.strip())]
    return []


def _human_count(count: object) -> str | None:
    if not isinstance(count, int):
        return None
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(count)


# ---- the loop ------------------------------------------------------------------------------------------------------


class Repl:
    """`>>>` loop over one model. `handle(line)` runs one input line and returns False when the user leaves."""

    def __init__(self, client: ReplClient, model: str, *, read: Callable[[str], str] | None = None,
                 out: TextIO | None = None, err: TextIO | None = None, verbose: bool = False) -> None:
        self.client, self.model = client, model
        self.read: Callable[[str], str] = read if read is not None else lambda prompt: input(prompt)
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.verbose = verbose
        self.messages: list[Message] = []
        self.options: dict[str, object] = {}
        self.system: str | None = None
        self.pending_images: list[str] = []

    def loop(self) -> int:
        """Read and run lines until /bye or Ctrl-D; Ctrl-C at the prompt only reminds how to leave."""
        while True:
            try:
                line = self.read(">>> ")
                if not self.handle(line):
                    return 0
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\nUse Ctrl + d or /bye to exit.\n")

    def handle(self, line: str) -> bool:
        text = line.strip()
        if not text:
            return True
        if text.startswith(_TRIPLE):
            self.send(read_multiline(line, self.read))
            return True
        if text.startswith("/") and not self._starts_with_image_path(text):
            return self.command(text)
        self.send(text)
        return True

    def command(self, text: str) -> bool:
        name, _, rest = text.partition(" ")
        if name in ("/bye", "/exit"):
            return False
        handlers: dict[str, Callable[[str], None]] = {
            "/?": self._help, "/help": self._help, "/clear": self._clear, "/show": self._show, "/set": self._set,
            "/unset": self._unset, "/image": self._image, "/audio": self._audio, "/load": self._load,
        }
        handler = handlers.get(name)
        if handler is None:
            self.out.write(f"Unknown command '{name}'. Type /? for help\n")
        else:
            handler(rest.strip())
        return True

    def send(self, text: str) -> None:
        """Send one user message with any attached images; print the streamed reply; keep both in the history."""
        try:
            message = self._user_message(text)
        except ClientError as exc:
            self.err.write(f"Error: {exc.message}\n")
            return
        history = [{"role": "system", "content": self.system}] if self.system else []
        try:
            reply, final = stream_reply(self.client.chat(self.model, [*history, *self.messages, message],
                                                         options=self.options or None), self.out)
        except KeyboardInterrupt:
            self.out.write("\n")
            return
        except ClientError as exc:
            self.out.write("\n")
            self.err.write(f"Error: {exc.message}\n")
            return
        self.out.write("\n\n")
        if self.verbose and final:
            self.err.write(format_stats(final) + "\n\n")
        self.messages += [message, {"role": "assistant", "content": reply}]

    def _user_message(self, text: str) -> Message:
        message, paths = user_message(text, self.pending_images)
        for path in paths:
            self.out.write(f"Added {media_kind(path)} '{path}'\n")
        self.pending_images = []
        return message

    def _starts_with_image_path(self, text: str) -> bool:
        first = text.split()[0]
        return any(written.startswith(first) for written, _ in find_image_paths(text))

    def _help(self, _: str) -> None:
        self.out.write(HELP)

    def _clear(self, _: str) -> None:
        self.messages, self.pending_images = [], []
        self.out.write("Cleared session context\n")

    def _show(self, rest: str) -> None:
        section = rest or "info"
        if section not in SHOW_SECTIONS:
            self.out.write(f"Usage: /show {'|'.join(SHOW_SECTIONS)}\n")
            return
        try:
            text = render_show(with_session(self.client.show(self.model), self.options, self.system), section)
        except ClientError as exc:
            self.err.write(f"Error: {exc.message}\n")
            return
        self.out.write((text or f"No {section} was specified for this model.") + "\n")

    def _set(self, rest: str) -> None:
        what, _, value = rest.partition(" ")
        if what == "parameter":
            try:
                name, parsed = parse_set_parameter(value.split())
            except ValueError as exc:
                self.out.write(f"Couldn't set parameter: {exc}\n")
                return
            self.options[name] = parsed
            self.out.write(f"Set parameter '{name}' to '{_show_value(parsed)}'\n")
        elif what == "system" and value.strip():
            self.system = read_multiline(value, self.read) if value.lstrip().startswith(_TRIPLE) else value.strip()
            self.out.write("Set system message.\n")
        elif what in ("verbose", "quiet"):
            self.verbose = what == "verbose"
            self.out.write(f"Set '{what}' mode.\n")
        else:
            self.out.write("Usage: /set parameter NAME VALUE | /set system TEXT | /set verbose | /set quiet\n")

    def _unset(self, rest: str) -> None:
        what, _, name = rest.partition(" ")
        if what == "parameter" and name.strip():
            self.options.pop(name.strip(), None)
            self.out.write(f"Unset parameter '{name.strip()}'\n")
        elif what == "system":
            self.system = None
            self.out.write("Unset system message.\n")
        else:
            self.out.write("Usage: /unset parameter NAME | /unset system\n")

    def _image(self, rest: str) -> None:
        self._attach(rest, "image", IMAGE_SUFFIXES)

    def _audio(self, rest: str) -> None:
        self._attach(rest, "audio", AUDIO_SUFFIXES)

    def _attach(self, rest: str, kind: str, suffixes: tuple[str, ...]) -> None:
        text, paths = extract_images(rest)
        if not paths or any(path.suffix.lower() not in suffixes for path in paths):
            self.out.write(f"Usage: /{kind} PATH [QUESTION] (PATH must be an existing "
                           f"{'/'.join(suffixes)} file)\n")
            return
        try:
            self.pending_images += [encode_image(path) for path in paths]
        except ClientError as exc:
            self.err.write(f"Error: {exc.message}\n")
            return
        for path in paths:
            self.out.write(f"Added {kind} '{path}'\n")
        if text:
            self.send(text)

    def _load(self, rest: str) -> None:
        if not rest:
            self.out.write("Usage: /load MODEL\n")
            return
        try:
            self.client.show(rest)
        except ClientError as exc:
            self.err.write(f"Error: {exc.message}\n")
            return
        self.model = rest
        self.out.write(f"Loading model '{rest}'\n")


def _show_value(value: object) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)
