"""Starting a server for the client commands: `lmserve serve` in the background when nothing answers at a local
address, its output in server.log in the model store (LMSERVE_MODELS); waiting until it answers."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lmserve.config import OPTIONS, resolve

if TYPE_CHECKING:
    from lmserve.client import Client


class _Process(Protocol):
    def poll(self) -> int | None: ...


SERVER_LOG = "server.log"
"""The output of a server the CLI starts, in its model store (LMSERVE_MODELS)."""
_LOCAL_HOSTS = frozenset({"localhost", "0.0.0.0", "::1", "::"})


def server_log(env: Mapping[str, str]) -> Path:
    """Where a server that the CLI starts writes its output: server.log in the model store that server uses
    (LMSERVE_MODELS in `env`, else the default ~/.lmserve/models)."""
    names = OPTIONS["models_dir"].env_names
    models_dir = resolve({}, {name: env[name] for name in names if name in env}).models_dir
    return Path(models_dir).expanduser() / SERVER_LOG


def ensure_server(client: Client, *, spawn: Callable[[str, Path], _Process] | None = None,
                  sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                  wait_s: float = 60.0, env: Mapping[str, str] | None = None) -> None:
    """Start `lmserve serve` in the background when nothing answers at a local address; wait until it answers.
    Its output goes to `server_log(env)` (default env: os.environ, which the server inherits).

    Something that answers but is not a usable lmserve (it wants an API key, or it is another program) is reported
    as a ClientError, and no server is started: the port is taken. Something that accepts the connection but does
    not answer yet (a server still starting, or busy) is waited for, and none is started.
    """
    from lmserve.client import ClientError

    answers = _answers(client)
    if answers:
        return
    process: _Process | None = None
    log = server_log(os.environ if env is None else env)
    if answers is False:
        process = _start(client, log, spawn)
    deadline = clock() + wait_s
    while clock() < deadline:
        if _answers(client):
            return
        code = process.poll() if process is not None else None
        if code is not None:
            raise ClientError(f"the server exited with code {code} while starting; see {log}")
        sleep(0.25)
    raise ClientError(f"the server did not answer at {client.base_url} within {wait_s:.0f} s; see {log}")


def _answers(client: Client) -> bool | None:
    """True when lmserve answers, False when nothing does, None when something accepted but has not answered yet."""
    from lmserve.client import ServerBusy

    try:
        return client.check_server()
    except ServerBusy:
        return None


def _start(client: Client, log: Path, spawn: Callable[[str, Path], _Process] | None) -> _Process:
    """Start `lmserve serve` in the background for a local address (a remote one is reported unreachable)."""
    from urllib.parse import urlsplit

    from lmserve.client import ClientError, ServerUnreachable

    host = urlsplit(client.base_url).hostname or ""
    if host not in _LOCAL_HOSTS and not host.startswith("127."):
        raise ServerUnreachable(client.base_url)
    print(f"lmserve is not running at {client.base_url}; starting it in the background (log: {log})",
          file=sys.stderr)
    try:
        return (spawn or _spawn_server)(client.base_url, log)
    except OSError as exc:
        raise ClientError(f"could not start the server (log {log}): {exc.strerror or exc}") from None


class _Detached:
    """A server started in a session of its own, meant to outlive the CLI. Not a subprocess.Popen: its finalizer
    warns (ResourceWarning) about a child that is still running, which this one is on purpose."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._code: int | None = None

    def poll(self) -> int | None:
        """The exit status once the server has ended, else None."""
        if self._code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code


def _spawn_server(base_url: str, log: Path) -> _Process:
    """`python -m lmserve serve` at `base_url`'s address, in a new session, stdin /dev/null, output appended to
    `log`."""
    from urllib.parse import urlsplit

    split = urlsplit(base_url)
    env = dict(os.environ, LMSERVE_HOST=split.hostname or "127.0.0.1", LMSERVE_PORT=str(split.port or 11434))
    log.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, out, 1),
                   (os.POSIX_SPAWN_DUP2, out, 2)]
        pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "lmserve", "serve"], env, file_actions=actions,
                             setsid=True)
    finally:
        os.close(out)
    return _Detached(pid)
