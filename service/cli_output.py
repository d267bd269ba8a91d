"""How the ``multicomposite`` command writes: tables, JSON and progress.

On a terminal, tables and progress bars are drawn by rich; anywhere else (a pipe, a file, a test) the same content
comes as plain lines with no escape codes and no bars, so that it can be read by ``grep``, ``cut`` and diff. Progress
always goes to stderr, results to stdout; ``--json`` output is exactly one JSON document on stdout.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

Progress = Callable[[int, int, str], None]


class UsageError(Exception):
    """Bad input on the command line: ``main`` prints it as one line on stderr and exits with code 2."""


PLAIN_PROGRESS_STEP = 10  # percent: a plain progress line at most every this many percent (and at the end)


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (rich output there, plain lines elsewhere)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _console(stream: TextIO, *, live: bool = False) -> Any:
    """A rich console on ``stream``, as wide as the terminal. ``live``: for a progress bar, which rich would draw
    only at its end unless it is told the stream is a terminal (``is_terminal`` already said so)."""
    from rich.console import Console

    # The stream is looked up when writing, so that a redirected sys.stdout (a test's capture) is honoured.
    return Console(file=stream, highlight=False, soft_wrap=False, force_terminal=True if live else None)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def plain_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """``rows`` under a header, columns padded to their widest cell and two spaces apart; the last column is not
    padded (it holds free text: reasons, details)."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(name)] + [len(row[i]) for row in cells]) for i, name in enumerate(columns)]
    lines = []
    for row in [list(columns), *cells]:
        padded = [text.ljust(widths[i]) if i < len(row) - 1 else text for i, text in enumerate(row)]
        lines.append("  ".join(padded).rstrip())
    return lines


def footnote_repeats(rows: Sequence[Sequence[object]], *, separator: str = "; ",
                     ) -> tuple[list[tuple[object, ...]], list[str]]:
    """``rows`` with their last column (free text: notes, details) shortened: each part of it (split on
    ``separator``) that more than one row carries becomes a mark, ``[1]``, and is printed once in the returned
    notes (``[1] re-measured 2x: ...``). A table of one run otherwise repeats the run's note on every row."""
    counts: dict[str, int] = {}
    for row in rows:
        for part in dict.fromkeys(str(row[-1] or "").split(separator)):
            if part:
                counts[part] = counts.get(part, 0) + 1
    marks: dict[str, str] = {}
    shortened = []
    for row in rows:
        parts = []
        for part in str(row[-1] or "").split(separator) if row[-1] is not None else []:
            if counts.get(part, 0) > 1:
                part = marks.setdefault(part, f"[{len(marks) + 1}]")
            parts.append(part)
        shortened.append((*row[:-1], separator.join(p for p in parts if p) if row[-1] is not None else None))
    return shortened, [f"{mark} {part}" for part, mark in marks.items()]


def _rich_table(columns: Sequence[str], rows: Sequence[Sequence[object]], title: str | None,
                last_min_width: int | None) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    # The last column (free text: reasons, details) takes what is left of the terminal's width and wraps there; a
    # cell too wide for its column folds onto the next line: nothing is cut off.
    for i, name in enumerate(columns):
        last = i == len(columns) - 1
        table.add_column(name, overflow="fold", min_width=last_min_width if last else None, ratio=1 if last else None)
    for row in rows:
        table.add_row(*(_cell(value) for value in row))
    return table


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None) -> None:
    """A table on stdout: rich on a terminal, ``plain_table`` lines elsewhere (the title as a first line)."""
    if is_terminal(sys.stdout):
        from rich.measure import Measurement

        console = _console(sys.stdout)
        table = _rich_table(columns, rows, title, last_min_width=20)
        unbounded = console.options.update(width=1 << 20)  # the table's own width, not one clamped to the terminal
        if Measurement.get(console, unbounded, table).maximum > console.width:
            # It must wrap: the last column gets what is left, or a 20-wide one makes rich crop the right edge.
            table = _rich_table(columns, rows, title, last_min_width=None)
        console.print(table)
        return
    if title:
        print(title)
    for line in plain_table(columns, rows):
        print(line)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a float becomes null (an error that could not be computed)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def print_json(value: Any) -> None:
    """One JSON document on stdout (strict JSON: no NaN), and nothing else."""
    sys.stdout.write(json.dumps(_finite(value), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def note(command: str, text: str) -> None:
    """A remark about the run (not a result) on stderr: ``multicomposite verify: ...``."""
    print(f"multicomposite {command}: {text}", file=sys.stderr)


@contextmanager
def progress(command: str, what: str) -> Iterator[Progress]:
    """A ``progress(done, total, label)`` callback for the length of the block, writing to stderr: on a terminal a
    rich bar, drawn as soon as the block starts ("starting" until the first report), with the time elapsed and an
    estimate of the time left; elsewhere one plain line per PLAIN_PROGRESS_STEP percent (and the last), such as
    ``multicomposite verify: entries 40/120 (33%) index_fill/functional vmap all``; a report of nothing done yet
    (0 of N) prints no plain line."""
    if is_terminal(sys.stderr):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar
        from rich.table import Column

        # The counts and times never shrink; the label takes what is left of the line and is cut with an ellipsis
        # (on an 80-column terminal a long label squeezed the times to "0:…").
        def fixed(column: Any, width: int) -> Any:
            column.get_table_column().min_width = width
            column.get_table_column().no_wrap = True
            return column

        with Bar(TextColumn(f"{what}"), BarColumn(bar_width=20), fixed(MofNCompleteColumn(), 11),
                 fixed(TimeElapsedColumn(), 7), TextColumn("elapsed,"), fixed(TimeRemainingColumn(), 7),
                 TextColumn("left"),
                 TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                 expand=True,
                 console=_console(sys.stderr, live=True), transient=False) as bar:
            task = bar.add_task("starting", total=None)
            bar.refresh()  # now, not at the first report: loading the harness and the first entries take seconds

            def advance(done: int, total: int, label: str) -> None:
                bar.update(task, completed=done, total=total, description=label[:60])

            yield advance
        return
    last_step = [-1]

    def line(done: int, total: int, label: str) -> None:
        if done == 0 and total:
            return
        percent = 100 * done // total if total else 100
        step = percent // PLAIN_PROGRESS_STEP
        if step == last_step[0] and done != total:
            return
        last_step[0] = step
        print(f"multicomposite {command}: {what} {done}/{total} ({percent}%) {label}".rstrip(), file=sys.stderr,
              flush=True)

    yield line
