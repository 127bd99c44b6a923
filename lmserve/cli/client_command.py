"""What every client command shares: its --help epilog, the client it talks through, and its errors as one
`Error: …` line with exit status 1.

A client command is a `Command` built by `client_command` from a handler that takes the client and the parsed
arguments; `run_client` makes the client (lmserve.client, imported lazily so `lmserve --help` stays fast), starts a
server when none answers (lmserve/cli/autostart.py) and calls the handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmserve.cli.autostart import ensure_server
from lmserve.cli.command import Command, Subparsers

if TYPE_CHECKING:
    from lmserve.client import Client

Handler = Callable[["Client", argparse.Namespace], int]
"""What a client command does, given the client and its parsed arguments; returns the exit status."""

CLIENT_ENVIRONMENT = """environment:
  LMSERVE_HOST      the server's address: host, host:port or http(s)://host:port (default 127.0.0.1)
  LMSERVE_PORT      the server's port when LMSERVE_HOST names none (default 11434)
  LMSERVE_API_KEY   the key of a server started with --api-key (sent as Authorization: Bearer)
  LMSERVE_MODELS    the model store of a server started here when none answers; its log is server.log there"""
"""The epilog of every client command's --help: where the server is and its key (lmserve.client reads them), and
the model store of a server started here."""


def client_command(name: str, handler: Handler, *, arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                   **parser_kwargs: Any) -> Command:
    """A client command named `name`: its parser takes `parser_kwargs` (help, description, aliases) and the
    arguments that `arguments` adds, and its --help ends with the variables that say where the server is."""

    def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(name, epilog=CLIENT_ENVIRONMENT,
                                       formatter_class=argparse.RawDescriptionHelpFormatter, **parser_kwargs)
        if arguments is not None:
            arguments(parser)
        parser.set_defaults(client_handler=handler)
        return parser

    return Command(name, add_parser, run_client)


def run_client(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run a client command: make the client (a bad LMSERVE_HOST is `Error: …` and 1), then `dispatch`."""
    from lmserve.client import Client, ClientError

    try:
        client = Client()
    except ClientError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    with client:
        return dispatch(args, client)


def dispatch(args: argparse.Namespace, client: Client, *, start_server: bool = True) -> int:
    """Run one client command; print `Error: …` and return 1 on a failure the server or the network reports."""
    from lmserve.client import ClientError

    handler: Handler = args.client_handler
    try:
        if start_server:
            ensure_server(client)
        return handler(client, args)
    except ClientError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
