"""`lmserve serve`: run the HTTP server, under the supervisor, on Ray Serve replicas, or as the server process."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lmserve.cli.command import Command, Subparsers
from lmserve.config import ConfigError, ServerConfig, add_arguments, environment_help, resolve


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve",
        help="run the HTTP server",
        description="Load a model and serve the OpenAI-compatible routes. Every flag can also be set with the "
        "LMSERVE_* environment variable named in its help; a flag wins over the variable.",
        epilog=environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(serve)
    return serve


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run `lmserve serve`; a flag or variable with an unusable value is one line on stderr and exit status 2."""
    try:
        config = resolve(vars(args))
    except ConfigError as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        return 2
    return _serve(config, argv)


def _serve(config: ServerConfig, argv: Sequence[str]) -> int:
    """Run the server: under the supervisor (lmserve/supervisor.py), which starts this same command again as the
    server process, unless it is off or this is that process (or a headless node, which serves no port)."""
    from lmserve.listening import LISTEN_FD

    if config.replicas is not None or config.max_replicas is not None or config.min_replicas is not None:
        from lmserve.replicas.run import run as run_replicas  # Ray Serve restarts replicas: no supervisor

        return run_replicas(config)
    if config.supervisor and not config.value("headless") and LISTEN_FD not in os.environ:
        from lmserve.supervisor import serve_supervised

        return serve_supervised(config, argv)
    from lmserve.server import run as run_server

    return run_server(config)


COMMAND = Command("serve", add_parser, run)
