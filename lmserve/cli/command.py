"""What every `lmserve` command is: a name, the parser it adds, and the function that runs it.

The table of commands is `COMMANDS` in lmserve/cli/__init__.py; a new command is a `Command` and one row there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""Where a command adds its parser: the `COMMAND` subparsers of `lmserve`."""
Run = Callable[[argparse.Namespace, Sequence[str]], int]
"""What runs a command: the parsed arguments and the command line as given → the exit status."""


@dataclass(frozen=True, slots=True)
class Command:
    """One `lmserve` command. `add_parser` adds its parser (with its aliases, help and arguments) to the
    subparsers; `run` runs it with the parsed arguments and the command line as given (`serve`'s supervisor starts
    that again) and returns the exit status."""

    name: str
    add_parser: Callable[[Subparsers], argparse.ArgumentParser]
    run: Run
