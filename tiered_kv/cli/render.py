"""Output of the CLI: one JSON document, or rich tables; progress bars on stderr; exit codes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from tiered_kv.errors import BackendUnavailable, CredentialsRefused, TieredKVError
from tiered_kv.units import format_size

EXIT_OK = 0  # done; nothing wrong found
EXIT_PROBLEM = 1  # the command ran and found a problem (corrupt blocks, a key not found, ...)
EXIT_USAGE = 2  # bad usage or configuration: a missing path, a non-store, a bad URL
EXIT_UNAVAILABLE = 3  # the store (or metrics endpoint) cannot be reached now: try again later


def error_exit(exc: TieredKVError | OSError) -> tuple[str, int]:
    """The one line and the exit code of an error reported without a traceback: the store or
    endpoint unreachable now (3); any other typed error or an OS error (a path it cannot read or
    write) is bad usage or configuration (2). A server refusing the user or password it was given
    (CredentialsRefused: a Redis tier's URL, a metrics endpoint's 401 or 403) is configuration
    too (2): an engine counts such a tier as unavailable, but a tool's "try again later" would
    never mend it."""
    if isinstance(exc, CredentialsRefused):
        return str(exc), EXIT_USAGE
    if isinstance(exc, BackendUnavailable):
        return str(exc), EXIT_UNAVAILABLE
    if isinstance(exc, TieredKVError):
        return str(exc), EXIT_USAGE
    return f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""), EXIT_USAGE


def emit_json(document) -> None:
    print(json.dumps(document, indent=2, default=str))


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140, highlight=False)


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence], *,
          right: Sequence[str] = ()) -> Table:
    """Title and cells are shown as they are, never read as rich markup: they carry what the
    command found (a scrape's labels, a path), and ``[/x]`` in one was a MarkupError traceback."""
    t = Table(title=None if title is None else Text(title), title_justify="left")
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    for row in rows:
        t.add_row(*(Text("-" if v is None else str(v)) for v in row))
    return t


def size(n) -> str | None:
    return None if n is None else format_size(n)


def age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit}"
    return f"{seconds:.0f}s"


@contextmanager
def progress(description: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (only on a terminal); yields ``advance(n, total)``."""
    err = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=err, transient=True,
                   disable=not (enabled and err.is_terminal))
    with bar:
        task = bar.add_task(description, total=None)

        def advance(n: int, total: int) -> None:
            bar.update(task, advance=n, total=total)

        yield advance
