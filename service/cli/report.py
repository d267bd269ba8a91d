"""``multicomposite report``: the speedup over native per op and workload, as a table and (``--png``) bars."""

from __future__ import annotations

import argparse

from service import cli_output as out
from service.cli import arguments
from service.cli.store import fresh, open_store
from service.cli_output import UsageError


def run(args: argparse.Namespace) -> int:
    from registry.reports.plots import remeasured, render_speedups_png, speedup_bars

    store = open_store()
    try:
        matrix, profiles = fresh(store)
    finally:
        store.close()
    if not profiles:
        raise UsageError("the store has no fresh profiles; run `multicomposite profile` first")
    bars = speedup_bars(profiles, matrix)
    try:
        path = render_speedups_png(profiles, args.png, matrix=matrix, bars=bars) if args.png else None
    except ValueError as error:
        raise UsageError(str(error)) from None
    again = remeasured(profiles)
    if args.json:
        out.print_json({"png": str(path) if path else None, "bars": [vars(bar) for bar in bars],
                        "remeasured": again})
        return 0
    table, notes = out.footnote_repeats(
        [(b.op, b.workload, b.dtype, b.batch_size, b.composite,
          f"{b.speedup:.2f}x" if b.speedup is not None else None,
          f"{b.low:.2f}" if b.low is not None else None, f"{b.high:.2f}" if b.high is not None else None,
          f"invalid: {b.invalid}" if b.invalid is not None
          else "no valid native timing" if b.speedup is None
          else "re-measured" if b.remeasured else "")
         for b in bars])
    out.print_table(("op", "workload", "dtype", "batch", "composite", "speedup", "low", "high", "note"), table)
    for line in notes:
        print(line)
    if path is not None:
        print(f"wrote {path} ({len(bars)} bars; error bars: each median +- IQR/2)")
    print(f"re-measured (the first run was disturbed): {len(again) or 'none'}")
    for line in again:
        print(f"  {line}")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--png", type=arguments.png, default=None, help="also draw the bars into this PNG (the "
                        "folder must exist)")
    arguments.add_json(parser, "the bars (speedup over native with its spread, or why invalid)")
    parser.set_defaults(run=run)
