"""`lmserve batch IN.jsonl -o OUT.jsonl`: run a file of requests in OpenAI's batch format, offline or against a server.

Offline (the default) it loads the model in this process, as `lmserve serve` would with the same flags, and sends
each line through the app's own routes in process: no port, no server. With `--url` it sends the lines to a running
server over HTTP (LMSERVE_API_KEY as its key). Either way the lines run at the lowest priority, `--batch-concurrency` at
a time (endpoints/batch_lines.py), and each result is appended to OUT, whole and fsync'd, as soon as it is back: one
line per request (`response` for those that ran, `error` for those refused), in the order they finish.

OUT is the progress record too: run the same command again after an interruption and it skips every custom_id OUT
holds (a half-written last line is cut off first). `-` reads the input from stdin; `-o -` writes to stdout (then
nothing resumes). The exit status is 0 when every line ran, 1 when some were refused or failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any

from lmserve.cli.command import Command, Subparsers
from lmserve.config import ConfigError, ServerConfig, add_arguments, environment_help, resolve

BATCH_FLAGS = ("input", "output", "url")
"""The batch command's own arguments; the rest are `serve`'s (the model and how it loads)."""


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    batch = subparsers.add_parser(
        "batch", help="run a file of requests (OpenAI's batch format) offline or against a server",
        description="Run every line of IN (one request per line: custom_id, method, url, body, as OpenAI's Batch "
        "API takes them) and append each result to OUT as it finishes. Offline unless --url is given: the model "
        "loads in this process with the same flags as `lmserve serve`. Run it again to resume: lines whose "
        "custom_id OUT holds are skipped.",
        epilog=environment_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    batch.add_argument("input", metavar="IN", help="the requests, one JSON object per line ('-': stdin)")
    batch.add_argument("-o", "--output", metavar="OUT", required=True,
                       help="where results go, appended one line each ('-': stdout, not resumable)")
    batch.add_argument("--url", help="send the lines to the server at this address instead of loading the model here")
    add_arguments(batch)
    return batch


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run `lmserve batch`; the exit status."""
    from lmserve.dialects.table import batch_endpoints
    from lmserve.service.batch_lines import check_lines

    flags = {key: value for key, value in vars(args).items() if key not in (*BATCH_FLAGS, "command", "run_command")}
    try:
        config = resolve(flags)
    except ConfigError as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        return 2
    try:
        raw = sys.stdin.buffer.read() if args.input == "-" else Path(args.input).expanduser().read_bytes()
    except OSError as exc:
        print(f"lmserve: cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return 2
    checked = check_lines(raw.splitlines(), batch_endpoints())
    if checked.fatal or (not checked.is_jsonl and raw.strip()):
        print(f"lmserve: {args.input}: {checked.fatal or 'no JSONL request lines (one JSON object per line)'}",
              file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(checked, config, args.output, args.url, config.batch_concurrency))
    except KeyboardInterrupt:
        print("\nlmserve: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


async def _run(checked: Any, config: ServerConfig, output: str, url: str | None, concurrency: int) -> int:
    from lmserve.service.batch_lines import BatchLine, run_lines
    from lmserve.store.batches import ResultLog

    sink: ResultLog | _Stdout = _Stdout(sys.stdout) if output == "-" else ResultLog(Path(output).expanduser())
    # refusals are written first, so an OUT with lines has them already (those without a custom_id included)
    refused = [] if sink.num_lines else checked.refused
    todo = [line for line in checked.lines if line.custom_id not in sink.done]
    skipped = len(checked.lines) + len(checked.refused) - len(todo) - len(refused)
    counts = {"ok": 0, "failed": len(refused)}
    for line in refused:
        sink.append(line)
    if skipped:
        print(f"lmserve: {skipped} lines are in {output} already; running the other {len(todo)}", file=sys.stderr)
    progress = _progress(len(todo))
    task = progress.add_task("batch", total=len(todo))

    def on_result(line: BatchLine, result: dict[str, Any]) -> None:
        sink.append(result)
        counts["ok" if result["response"]["status_code"] == 200 else "failed"] += 1
        progress.advance(task)

    try:
        send, close, model = await _sender(config, url)
        started = time.perf_counter()  # the rate is the lines', not the model load's
        for line in todo:
            line.body.setdefault("model", model)  # a line that names no model asks the one served
        with progress:
            try:
                await run_lines(todo, send, on_result, concurrency=concurrency)
            finally:
                await close()
    finally:
        sink.close()
    elapsed = time.perf_counter() - started
    ran = len(todo) + len(refused)
    print(f"lmserve: {ran} lines in {elapsed:.1f} s ({ran / max(elapsed, 1e-9):.2f}/s): "
          f"{counts['ok']} succeeded, {counts['failed']} failed" + (f", {skipped} done before" if skipped else ""),
          file=sys.stderr)
    return 1 if counts["failed"] else 0


async def _sender(config: ServerConfig, url: str | None) -> tuple[Any, Callable[[], Awaitable[None]], str]:
    """The Send of the lines, its closer, and the model of lines that name none: over HTTP to `url` (the model
    `--model` names, or the default), else the app of `config` in process (its model loaded first, the service
    closed by the closer)."""
    from lmserve.service.batch_lines import asgi_send, http_send

    if url is not None:
        return *http_send(url if "://" in url else f"http://{url}", config.api_key), config.model
    from lmserve.server import build_app

    _, name, app = await asyncio.to_thread(build_app, config, preload=True, resume_batches=False)
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    send, close_send = asgi_send(app, config.api_key)

    async def close() -> None:
        await close_send()
        await lifespan.__aexit__(None, None, None)

    return send, close, name


def _progress(total: int) -> Any:
    """A progress bar on stderr: done/total, the rate in lines a second, and the time left."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(f"{task.speed:.2f} lines/s" if task.speed else "- lines/s")

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=Console(stderr=True))


class _Stdout:
    """Result lines to stdout (`-o -`): nothing is done before, nothing resumes."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.done: set[str] = set()
        self.num_lines = 0

    def append(self, line: dict[str, Any]) -> None:
        self.stream.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.stream.flush()


COMMAND = Command("batch", add_parser, run)
