"""Command-line interface: `lmserve serve` runs the server; `lmserve batch` runs a file of requests
(lmserve/cli/batch.py); the other commands talk to a running server.

`run`, `create`, `list`/`ls`, `rm`, `show`, `ps`, `pull`, `cp` and `stop` follow the local runner's CLI. They use
`lmserve.client` (imported lazily, so `lmserve --help` stays fast) and start a server in the background when none
answers at LMSERVE_HOST / LMSERVE_PORT (default 127.0.0.1:11434) and nothing else answers there (its log:
server.log in the model store, LMSERVE_MODELS); they send LMSERVE_API_KEY when it is set. A failure prints one
`Error: …` line and exits 1; output whose reader went away (`lmserve run … | head`) ends quietly with 141.

Every command is a `Command` (lmserve/cli/command.py) in one table, `COMMANDS`, in the order `lmserve --help`
lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from lmserve import __version__
from lmserve.cli import batch, chat, models, serve, sign
from lmserve.cli.command import Command, Run

COMMANDS: tuple[Command, ...] = (serve.COMMAND, chat.COMMAND, *models.COMMANDS, batch.COMMAND, sign.COMMAND)
"""Every `lmserve` command, in the order of `lmserve --help`."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of `lmserve`: one subparser per command of COMMANDS, which records the command's `run`."""
    parser = argparse.ArgumentParser(prog="lmserve", description="Serve open-weight chat models over HTTP.")
    parser.add_argument("--version", action="version", version=f"lmserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers).set_defaults(run_command=command.run)
    return parser


STDOUT_CLOSED = 141
"""The exit status when the reader of stdout went away (`lmserve run … | head`): 128 + SIGPIPE, what a shell
reports for a Unix tool that SIGPIPE ended (`yes | head`)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run `lmserve ARGV…` and return its exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C before a command runs (while Python imports its modules): no traceback
        print(file=sys.stderr)
        return 130


def stdout_closed() -> int:
    """End quietly after stdout's reader went away: no traceback, and stdout becomes /dev/null so that the flush
    at exit cannot fail again (Python would print "Exception ignored … BrokenPipeError"). Returns STDOUT_CLOSED."""
    with contextlib.suppress(OSError, ValueError):  # stdout without a file descriptor (a test's buffer)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    return STDOUT_CLOSED


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    run: Run = args.run_command
    return run(args, argv)
