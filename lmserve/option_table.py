"""How a server option is declared: one entry per option, with its default, flags, environment variable, reading,
bounds and help (in the spirit of llama.cpp's `add_opt(...).set_env(...)`).

The server's own options are the fields of config.ServerConfig; each engine declares its own the same way, as the
fields of its launch record (engine/<name>/options.py), and config.py gathers them all into one table, from which
`lmserve serve`'s flags, its variables and its help are generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, TypeVar

from lmserve.parsing import format_duration

ENV_PREFIX = "LMSERVE_"
T = TypeVar("T")
Kind = Literal["str", "int", "float", "bool", "list", "duration"]


@dataclass(frozen=True, slots=True)
class Option:
    """One server option: how it is given (flags, environment), read (`kind`), checked and described."""

    env: str
    """The environment variable, without the LMSERVE_ prefix."""
    help: str
    flags: tuple[str, ...] = ()
    """`-c`, `--ctx-size` …; none: set through the environment only."""
    kind: Kind = "str"
    """How a text value is read: as is, an integer, a number, a switch (a flag without a value; 1/true/yes/on in
    the environment), a comma-separated list, or a duration (negative: forever)."""
    minimum: float | None = None
    maximum: float | None = None
    special: int | None = None
    """One value allowed outside the bounds (e.g. -1 for "unlimited")."""
    metavar: str | None = None
    shown: str | None = None
    """How the default reads in the help when the value alone says nothing ("all cores")."""
    positional: str | None = None
    """The option is also the positional argument of this name (the model to serve)."""
    choices: tuple[str, ...] = ()
    """The values allowed (none: any)."""
    env_aliases: tuple[str, ...] = ()
    """More environment variables (without the prefix) that set it, under the names other servers use."""
    load: str | None = None
    """The `types.LoadOptions` field this option is the server's default for (requests and Modelfiles may set it
    per model)."""
    engine: str | None = None
    """The one engine that understands the option (set for the options an engine declares; None: the server's)."""
    engine_label: str = ""
    """That engine's name as people write it ("llama.cpp")."""

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.env

    @property
    def name(self) -> str:
        """What an error message calls the option: its first long flag, else its variable."""
        return next((flag for flag in self.flags if flag.startswith("--")), self.env_name)

    def describe_default(self, default: object) -> str:
        if self.shown is not None:
            return self.shown
        if self.kind == "duration":
            return format_duration(default if isinstance(default, int | float) else None)
        if default is None or default == ():
            return "none"
        return str(default)

    @property
    def env_names(self) -> tuple[str, ...]:
        return (self.env_name, *(ENV_PREFIX + alias for alias in self.env_aliases))

    def help_text(self, default: object) -> str:
        """The help line: the text, then the default (filled in from the value) and the variable(s)."""
        engine = f"{self.engine_label} only; " if self.engine else ""
        return f"{self.help} (default {self.describe_default(default)}; {engine}{', '.join(self.env_names)})"


def option(default: T, *flags: str, env: str, help: str, kind: Kind = "str", minimum: float | None = None,
           maximum: float | None = None, special: int | None = None, metavar: str | None = None,
           shown: str | None = None, positional: str | None = None, choices: tuple[str, ...] = (),
           env_aliases: tuple[str, ...] = (), load: str | None = None) -> T:
    """A field of an options record (ServerConfig, an engine's launch record) that is also an entry of the table."""
    entry = Option(env=env, help=help, flags=flags, kind=kind, minimum=minimum, maximum=maximum, special=special,
                   metavar=metavar, shown=shown, positional=positional, choices=choices, env_aliases=env_aliases,
                   load=load)
    return field(default=default, metadata={"option": entry})


def entries(record: type) -> dict[str, tuple[Option, object]]:
    """The options a record declares: field name → (entry, default)."""
    return {f.name: (f.metadata["option"], f.default) for f in fields(record) if "option" in f.metadata}


class ConfigError(ValueError):
    """A flag or environment variable has a value lmserve cannot use."""
