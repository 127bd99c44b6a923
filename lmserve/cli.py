"""Command-line interface: `lmserve serve` runs the server; `lmserve batch` runs a file of requests
(lmserve/batch_command.py); the other commands talk to a running server.

`run`, `create`, `list`/`ls`, `rm`, `show`, `ps`, `pull`, `cp` and `stop` follow the local runner's CLI. They use
`lmserve.client` (imported lazily, so `lmserve --help` stays fast) and start a server in the background when none
answers at LMSERVE_HOST / LMSERVE_PORT (default 127.0.0.1:11434) and nothing else answers there (its log:
server.log in the model store, LMSERVE_MODELS); they send LMSERVE_API_KEY when it is set. A failure prints one
`Error: …` line and exits 1; output whose reader went away (`lmserve run … | head`) ends quietly with 141.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lmserve import __version__, batch_command
from lmserve.config import OPTIONS, ConfigError, ServerConfig, add_arguments, environment_help, resolve
from lmserve.parsing import model_name_for_file

if TYPE_CHECKING:
    from lmserve.client import Client


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve", description="Serve open-weight chat models over HTTP.")
    parser.add_argument("--version", action="version", version=f"lmserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server",
        description="Load a model and serve the OpenAI-compatible routes. Every flag can also be set with the "
        "LMSERVE_* environment variable named in its help; a flag wins over the variable.",
        epilog=environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(serve)
    _add_client_commands(commands)
    batch_command.add_parser(commands)
    return parser


CLIENT_ENVIRONMENT = """environment:
  LMSERVE_HOST      the server's address: host, host:port or http(s)://host:port (default 127.0.0.1)
  LMSERVE_PORT      the server's port when LMSERVE_HOST names none (default 11434)
  LMSERVE_API_KEY   the key of a server started with --api-key (sent as Authorization: Bearer)
  LMSERVE_MODELS    the model store of a server started here when none answers; its log is server.log there"""
"""The epilog of every client command's --help: where the server is and its key (lmserve.client reads them), and
the model store of a server started here."""


def _add_client_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A client command: its --help ends with the variables that say where the server is."""
        return commands.add_parser(name, epilog=CLIENT_ENVIRONMENT,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    run = command("run", help="chat with a model, or answer one prompt",
                  description="Interactive chat (/? for help) unless PROMPT is given or stdin is piped.")
    run.add_argument("model", help="model name, or a path to a .gguf file (created as a model named after the file)")
    run.add_argument("prompt", nargs="*", help="answer this prompt and exit")
    run.add_argument("--verbose", action="store_true", help="print timing statistics after each answer")
    create = command("create", help="create a model from a Modelfile")
    create.add_argument("model", help="name of the new model")
    create.add_argument("-f", "--file", default="Modelfile", help="path to the Modelfile (default ./Modelfile)")
    create.add_argument("-q", "--quantize", metavar="QUANT", help="quantize the weights (q4_K_M, q8_0, …)")
    command("list", aliases=["ls"], help="list models")
    rm = command("rm", help="remove models")
    rm.add_argument("models", nargs="+", metavar="MODEL")
    show = command("show", help="show information about a model")
    show.add_argument("model")
    sections = show.add_mutually_exclusive_group()
    for section in ("modelfile", "parameters", "template", "system", "license"):
        sections.add_argument(f"--{section}", dest="section", action="store_const", const=section,
                              help=f"show the model's {section}")
    command("ps", help="list loaded models")
    pull = command("pull", help="download a model")
    pull.add_argument("model")
    cp = command("cp", help="copy a model")
    cp.add_argument("source")
    cp.add_argument("destination")
    stop = command("stop", help="unload a running model")
    stop.add_argument("model")


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
    if args.command == "serve":
        try:
            config = resolve(vars(args))
        except ConfigError as exc:
            print(f"lmserve: {exc}", file=sys.stderr)
            return 2
        return _serve(config, argv)
    if args.command == "batch":
        return batch_command.run(args)
    from lmserve.client import Client, ClientError

    try:
        client = Client()
    except ClientError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    with client:
        return dispatch(args, client)


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
    from lmserve.server import run

    return run(config)


def dispatch(args: argparse.Namespace, client: Client, *, start_server: bool = True) -> int:
    """Run one client command; print `Error: …` and return 1 on a failure the server or the network reports."""
    from lmserve.client import ClientError

    commands: dict[str, Callable[[Client, argparse.Namespace], int]] = {
        "run": _run, "create": _create, "list": _list, "ls": _list, "rm": _rm, "show": _show, "ps": _ps,
        "pull": _pull, "cp": _cp, "stop": _stop,
    }
    try:
        if start_server:
            ensure_server(client)
        return commands[args.command](client, args)
    except ClientError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# ---- commands ------------------------------------------------------------------------------------------------------


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
    from lmserve.repl import format_stats, stream_reply, user_message

    message, _ = user_message(prompt)
    _, final = stream_reply(client.chat(model, [message]), sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose and final:
        print(format_stats(final), file=sys.stderr)
    return 0


def _interactive(client: Client, model: str, verbose: bool) -> int:
    from rich.console import Console

    from lmserve.repl import Repl

    with contextlib.suppress(ImportError):  # line editing and history for input(), where the platform has it
        import readline  # noqa: F401
    with Console(stderr=True).status(f"loading {model}"):
        list(client.generate(model, "", stream=False))
    return Repl(client, model, verbose=verbose).loop()


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
    from lmserve.repl import render_show

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


# ---- starting a server ---------------------------------------------------------------------------------------------


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


# ---- pure helpers --------------------------------------------------------------------------------------------------


def human_size(size: object) -> str:
    """Bytes in decimal units as the local runner prints them: `512 B`, `1.5 KB`, `270 MB`, `4.7 GB`."""
    value = size if isinstance(size, int | float) else 0
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if value >= scale:
            scaled = value / scale
            return f"{int(scaled)} {unit}" if scaled >= 10 or scaled == int(scaled) else f"{scaled:.1f} {unit}"
    return f"{int(value)} B"


def parse_time(text: object) -> datetime | None:
    """An RFC 3339 time from the API (nanoseconds allowed); None when missing or unreadable."""
    if not isinstance(text, str) or not text:
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", text)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def human_duration(seconds: float) -> str:
    """`Less than a second`, `5 seconds`, `About a minute`, `3 hours`, `2 weeks` … (the local runner's wording)."""
    if seconds < 1:
        return "Less than a second"
    if seconds < 60:
        return "1 second" if int(seconds) == 1 else f"{int(seconds)} seconds"
    minutes = int(seconds // 60)
    if minutes < 60:
        return "About a minute" if minutes == 1 else f"{minutes} minutes"
    hours = round(seconds / 3600)
    for limit, divisor, unit in ((48, 1, "hours"), (24 * 14, 24, "days"), (24 * 60, 24 * 7, "weeks"),
                                 (24 * 730, 24 * 30, "months")):
        if hours < limit:
            return "About an hour" if hours == 1 else f"{hours // divisor} {unit}"
    return f"{int(seconds // (3600 * 24 * 365))} years"


def human_time(when: datetime | None, now: datetime, zero: str = "") -> str:
    """`3 minutes ago`, `4 minutes from now`, or `Forever` for a time more than 20 years ahead."""
    if when is None or when.year <= 1:
        return zero
    delta = (now - when).total_seconds()
    if delta < -20 * 365 * 24 * 3600:
        return "Forever"
    return f"{human_duration(-delta)} from now" if delta < 0 else f"{human_duration(delta)} ago"


def processor(size: object, size_vram: object) -> str:
    """Where a loaded model lives: `100% CPU`, `100% GPU` or `30%/70% CPU/GPU`."""
    total = size if isinstance(size, int) and size > 0 else 0
    vram = size_vram if isinstance(size_vram, int) else 0
    if total == 0 or vram == 0:
        return "100% CPU"
    if vram >= total:
        return "100% GPU"
    gpu = round(100 * vram / total)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def short_id(digest: object) -> str:
    """The first 12 hex digits of a digest (`sha256:` prefix dropped)."""
    return str(digest or "").removeprefix("sha256:")[:12]


def format_table(rows: Sequence[Sequence[str]], gap: int = 4) -> str:
    """Left-aligned columns separated by at least `gap` spaces, no trailing blanks."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("".join(cell.ljust(w + gap) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


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


def show_progress(lines: Iterable[dict[str, Any]]) -> None:
    """Print status lines from create/pull on stderr; lines with a total become progress bars (one per digest)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        tasks: dict[str, Any] = {}
        for line in lines:
            status, total = str(line.get("status", "")), line.get("total")
            if isinstance(total, int) and total > 0:
                key = str(line.get("digest") or status)
                if key not in tasks:
                    tasks[key] = progress.add_task(status, total=total)
                progress.update(tasks[key], total=total, completed=line.get("completed") or 0)
            elif status:
                progress.console.print(status, highlight=False, markup=False)
