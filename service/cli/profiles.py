"""``multicomposite profiles``: the stored timings, each with native's over its own. A note that several rows of
a run share (a re-measurement, an overlapping run) is printed once under the table and the rows point to it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from service import cli_output as out
from service.cli import arguments
from service.cli.store import entry_json, fresh, open_store

if TYPE_CHECKING:
    from registry.store.records import ProfileEntry

COLUMNS = ("op", "workload", "dtype", "batch", "composite", "median us", "IQR us", "vs native", "detail")


def rows(entries: Sequence[ProfileEntry]) -> list[tuple[object, ...]]:
    native = {(e.op, e.workload, e.numel_bucket, e.batch_size, e.dtype, e.device): e.median_us
              for e in entries if e.kind == "native" and e.valid}
    table: list[tuple[object, ...]] = []
    for e in entries:
        base = native.get((e.op, e.workload, e.numel_bucket, e.batch_size, e.dtype, e.device))
        if not e.valid:
            table.append((e.op, e.workload, e.dtype, e.batch_size, e.composite, None, None, None,
                          f"invalid: {e.detail}"))
            continue
        ratio = f"{base / e.median_us:.2f}x" if base and e.median_us else None
        table.append((e.op, e.workload, e.dtype, e.batch_size, e.composite, f"{e.median_us:.1f}",
                      f"{e.iqr_us or 0.0:.1f}", ratio, e.detail))
    return table


def print_profiles(entries: Sequence[ProfileEntry]) -> None:
    """The table, with notes shared by several rows printed once below it."""
    table, notes = out.footnote_repeats(rows(entries))
    out.print_table(COLUMNS, table)
    for line in notes:
        print(line)


def run(args: argparse.Namespace) -> int:
    store = open_store()
    try:
        _, profiles = fresh(store, entries=False)
    finally:
        store.close()
    shown = [p for p in profiles if (not args.op or p.op in args.op) and (not args.workload
             or p.workload in args.workload) and (args.dtype is None or p.dtype == args.dtype)
             and (args.status is None or p.valid == (args.status == "valid"))]
    if args.json:
        out.print_json([entry_json(p) for p in shown])
        return 0
    print_profiles(shown)
    print(f"{len(shown)} profiles")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=arguments.op, help="only this op (repeatable; default: all)")
    parser.add_argument("--workload", action="append", type=arguments.workload, help="only this workload: vmap, "
                        "grad, vmap(grad), jacrev, jacfwd, hessian (repeatable; default: all)")
    parser.add_argument("--dtype", default=None, type=arguments.any_dtype, help="only this dtype, e.g. float32")
    parser.add_argument("--status", default=None, choices=("valid", "invalid"),
                        help="only timed (valid) or only invalid profiles")
    arguments.add_json(parser, "the stored profiles")
    parser.set_defaults(run=run)
