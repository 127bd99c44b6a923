"""The listening socket of `lmserve serve`: bound before anything is announced, and handed from the supervisor to
the server process it starts (lmserve/supervisor.py) through an inherited file descriptor."""

from __future__ import annotations

import errno
import os
import socket

LISTEN_FD = "LMSERVE_LISTEN_FD"
"""The environment variable that names the listening socket's file descriptor in a supervised server process."""


class BindError(OSError):
    """The listen address cannot be bound (the port is taken, the host is not this machine's …)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, made before anything is announced. Connections that come while the model
    loads wait in its backlog until uvicorn serves them (a client sees a slow answer, never a refused connection).

    Raises BindError with one line that says why (`port 11434 on 127.0.0.1 is already in use`).
    """
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise BindError(f"cannot listen on {host!r}: {getattr(exc, 'strerror', None) or exc}") from None
    family, kind, proto, _, address = min(found, key=lambda info: info[0] != socket.AF_INET)  # IPv4 first
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise BindError(f"port {port} on {host} is already in use") from None
        raise BindError(f"cannot listen on {host} port {port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def inherited_socket() -> socket.socket | None:
    """The listening socket a supervisor handed to this process (LISTEN_FD, taken out of the environment so that
    processes this one starts do not see it), or None when this process was not started by one."""
    fd = os.environ.pop(LISTEN_FD, None)
    if fd is None:
        return None
    sock = socket.socket(fileno=int(fd))
    sock.set_inheritable(False)
    return sock
