"""The client commands about models: `create`, `list`/`ls`, `rm`, `show`, `ps`, `pull`, `cp` and `stop`, as the
local runner's CLI has them; and how `create` makes a Modelfile's file paths absolute before sending it."""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lmserve.cli.client_command import client_command
from lmserve.cli.formatting import format_table, human_size, human_time, parse_time, processor, short_id, show_progress

if TYPE_CHECKING:
    from lmserve.client import Client


def _create(client: Client, args: argparse.Namespace) -> int:
    from lmserve.client import ClientError

    path = Path(args.file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ClientError(f"could not read Modelfile {str(path)!r}: {exc.strerror}") from None
    text = rewrite_modelfile_paths(text, path.resolve().parent)
    show_progress(client.create(args.model, text, quantize=args.quantize))
    return 0


def _list(client: Client, args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in client.tags().get("models") or []:
        rows.append([str(m.get("name") or m.get("model")), short_id(m.get("digest")), human_size(m.get("size")),
                     human_time(parse_time(m.get("modified_at")), now)])
    print(format_table(rows))
    return 0


def _ps(client: Client, args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "UNTIL"]]
    for m in client.ps().get("models") or []:
        until = parse_time(m.get("expires_at"))
        rows.append([str(m.get("name") or m.get("model")), short_id(m.get("digest")), human_size(m.get("size")),
                     processor(m.get("size"), m.get("size_vram")),
                     "Stopping..." if until is not None and until < now else human_time(until, now, zero="Forever")])
    print(format_table(rows))
    return 0


def _show(client: Client, args: argparse.Namespace) -> int:
    from lmserve.cli.repl import render_show

    print(render_show(client.show(args.model), args.section or "info"))
    return 0


def _rm(client: Client, args: argparse.Namespace) -> int:
    for model in args.models:
        client.delete(model)
        print(f"deleted '{model}'")
    return 0


def _pull(client: Client, args: argparse.Namespace) -> int:
    show_progress(client.pull(args.model))
    return 0


def _cp(client: Client, args: argparse.Namespace) -> int:
    client.copy(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def _stop(client: Client, args: argparse.Namespace) -> int:
    client.stop(args.model)
    return 0


# ---- arguments -----------------------------------------------------------------------------------------------------


def _create_arguments(create: argparse.ArgumentParser) -> None:
    create.add_argument("model", help="name of the new model")
    create.add_argument("-f", "--file", default="Modelfile", help="path to the Modelfile (default ./Modelfile)")
    create.add_argument("-q", "--quantize", metavar="QUANT", help="quantize the weights (q4_K_M, q8_0, …)")


def _rm_arguments(rm: argparse.ArgumentParser) -> None:
    rm.add_argument("models", nargs="+", metavar="MODEL")


def _show_arguments(show: argparse.ArgumentParser) -> None:
    show.add_argument("model")
    sections = show.add_mutually_exclusive_group()
    for section in ("modelfile", "parameters", "template", "system", "license"):
        sections.add_argument(f"--{section}", dest="section", action="store_const", const=section,
                              help=f"show the model's {section}")


def _model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")


def _cp_arguments(cp: argparse.ArgumentParser) -> None:
    cp.add_argument("source")
    cp.add_argument("destination")


COMMANDS = (
    client_command("create", _create, arguments=_create_arguments, help="create a model from a Modelfile"),
    client_command("list", _list, aliases=["ls"], help="list models"),
    client_command("rm", _rm, arguments=_rm_arguments, help="remove models"),
    client_command("show", _show, arguments=_show_arguments, help="show information about a model"),
    client_command("ps", _ps, help="list loaded models"),
    client_command("pull", _pull, arguments=_model_argument, help="download a model"),
    client_command("cp", _cp, arguments=_cp_arguments, help="copy a model"),
    client_command("stop", _stop, arguments=_model_argument, help="unload a running model"),
)
"""The model commands, in the order of `lmserve --help`."""


# ---- Modelfile paths -----------------------------------------------------------------------------------------------


_PATH_DIRECTIVE = re.compile(r"^(?P<lead>\s*(?:FROM|ADAPTER)\s+)(?P<value>\S.*?)(?P<trail>\s*)$", re.IGNORECASE)


def rewrite_modelfile_paths(text: str, base: Path) -> str:
    """Make FROM/ADAPTER values that name existing files relative to the Modelfile (`base`) absolute paths."""
    lines = text.splitlines(keepends=True)
    in_block = False
    for index, line in enumerate(lines):
        body = line.rstrip("\r\n")
        match = None if in_block else _PATH_DIRECTIVE.match(body)
        if match is not None:
            value = _resolve_path(match["value"], base)
            lines[index] = match["lead"] + value + match["trail"] + line[len(body):]
        if body.count('"""') % 2:
            in_block = not in_block
    return "".join(lines)


def _resolve_path(value: str, base: Path) -> str:
    quoted = len(value) >= 2 and value[0] == value[-1] == '"' and not value.startswith('"""')
    raw = value[1:-1] if quoted else value
    path = Path(raw).expanduser()
    path = path if path.is_absolute() else base / path
    if Path(raw).is_absolute() or not path.exists():
        return value
    resolved = str(path.resolve())
    return '"' + resolved.replace("\\", "\\\\").replace('"', '\\"') + '"' if quoted else resolved
