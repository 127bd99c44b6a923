"""How the client commands print: sizes, times and processors as the local runner words them, tables, and the
progress of a create or pull."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any


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
