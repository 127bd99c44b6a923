"""`lmserve run MODEL [PROMPT]`: chat with a model (lmserve/cli/repl.py), or answer one prompt or piped stdin.

A model the server does not have is pulled first; a path to a .gguf file is created as a model named after the file.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lmserve.cli.client_command import client_command
from lmserve.cli.formatting import show_progress
from lmserve.parsing import model_name_for_file

if TYPE_CHECKING:
    from lmserve.client import Client


def _arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("model", help="model name, or a path to a .gguf file (created as a model named after the file)")
    run.add_argument("prompt", nargs="*", help="answer this prompt and exit")
    run.add_argument("--verbose", action="store_true", help="print timing statistics after each answer")


def _run(client: Client, args: argparse.Namespace) -> int:
    if _is_gguf(args.model):
        model = _create_from_gguf(client, args.model)
    else:
        model = args.model
        _ensure_model(client, model)
    prompt = " ".join(args.prompt)
    stdin = sys.stdin
    if stdin is not None and not stdin.isatty():
        piped = stdin.read()
        prompt = f"{prompt}\n\n{piped}" if prompt and piped.strip() else prompt or piped
        return _run_once(client, model, prompt, args.verbose) if prompt.strip() else 0
    if prompt:
        return _run_once(client, model, prompt, args.verbose)
    return _interactive(client, model, args.verbose)


def _run_once(client: Client, model: str, prompt: str, verbose: bool) -> int:
    from lmserve.cli.repl import format_stats, stream_reply, user_message

    message, _ = user_message(prompt)
    _, final = stream_reply(client.chat(model, [message]), sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose and final:
        print(format_stats(final), file=sys.stderr)
    return 0


def _interactive(client: Client, model: str, verbose: bool) -> int:
    from rich.console import Console

    from lmserve.cli.repl import Repl

    with contextlib.suppress(ImportError):  # line editing and history for input(), where the platform has it
        import readline  # noqa: F401
    with Console(stderr=True).status(f"loading {model}"):
        list(client.generate(model, "", stream=False))
    return Repl(client, model, verbose=verbose).loop()


def _is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _create_from_gguf(client: Client, text: str) -> str:
    """`run path/to/file.gguf`: create (or refresh) a model named after the file, from its absolute path."""
    from lmserve.client import ClientError

    path = Path(text).expanduser()
    if not path.is_file():
        raise ClientError(f"no such file: {text}")
    name = model_name_for_file(path)
    show_progress(client.create(name, from_=str(path.resolve())))
    return name


def _ensure_model(client: Client, model: str) -> None:
    """A model the server does not have is pulled first. When the pull fails, the 'not found' error stands, unless
    the name is a hub name (`hf.co/…`) and the download itself failed (then that failure is the news)."""
    from lmserve.client import ClientError

    try:
        client.show(model)
    except ClientError as exc:
        if exc.status != 404:
            raise
        try:
            show_progress(client.pull(model))
        except ClientError as pull_error:
            is_hub = model.lower().startswith(("hf.co/", "huggingface.co/"))
            raise (pull_error if is_hub and pull_error.status not in (400, 404) else exc) from None


COMMAND = client_command("run", _run, arguments=_arguments, help="chat with a model, or answer one prompt",
                         description="Interactive chat (/? for help) unless PROMPT is given or stdin is piped.")
