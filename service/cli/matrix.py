"""``multicomposite matrix``: the stored verified matrix, native's failures and auto's choice there (``--failing``),
or a heatmap (``--png``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from registry.core.status import STATUSES
from service import cli_output as out
from service.cli import arguments
from service.cli.store import entry_json, fresh, open_store
from service.cli_output import UsageError

if TYPE_CHECKING:
    from registry.store.records import MatrixEntry


def run(args: argparse.Namespace) -> int:
    from registry.core.stacks import format_stack
    from registry.reports.plots import render_matrix_png
    from registry.store.choices import native_failures

    if args.failing and args.png:
        raise UsageError("--failing lists cells; it has no PNG: drop --png, or --failing to render the matrix")
    store = open_store()
    try:
        everything, profiles = fresh(store, profiles=args.failing)  # only --failing ranks by the profiles
    finally:
        store.close()
    if not everything:
        raise UsageError("the store has no fresh entries; run `multicomposite verify` first")

    def keep(e: MatrixEntry) -> bool:
        return ((not args.op or e.op in args.op) and (not args.stack or e.stack in args.stack)
                and (args.composite is None or e.composite == args.composite)
                and (args.status is None or e.status == args.status))

    entries = [e for e in everything if keep(e)]
    if args.failing:
        # Every entry is the evidence (a choice depends on the other composites' cells); the filters pick the rows.
        rows = native_failures(everything, profiles)
        rows = [r for r in rows if (not args.op or r["op"] in args.op)
                and (not args.stack or r["stack"] in {format_stack(s) for s in args.stack})
                and (args.status is None or r["native_status"] == args.status)
                and (args.composite is None or r["composite"] == args.composite)]
        if args.json:
            out.print_json(rows)
            return 0
        out.print_table(("op", "stack", "pattern", "dtype", "native", "choice", "kind", "status", "reason"),
                        [(r["op"], r["stack"], r["pattern"], r["dtype"], r["native_status"], r["composite"],
                          r["kind"], r["status"], r["reason"]) for r in rows])
        print(f"{len(rows)} cells where native fails")
        return 0
    if args.png:
        if not entries:
            raise UsageError("no entries match these filters; nothing to render")
        path = render_matrix_png(entries, args.png)
        if args.json:
            out.print_json({"png": str(path), "entries": len(entries)})
        else:
            print(f"wrote {path} ({len(entries)} entries)")
        return 0
    if args.json:
        out.print_json([entry_json(e) for e in entries])
        return 0
    out.print_table(("op", "composite", "stack", "pattern", "dtype", "status", "detail"),
                    [(e.op, e.composite, format_stack(e.stack) or "eager", e.pattern, e.dtype, e.status, e.detail)
                     for e in entries])
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=arguments.op, help="only this op (repeatable; default: all)")
    parser.add_argument("--stack", action="append", type=arguments.stack, help="only this stack, vmap(grad) or "
                        "vmap,grad (repeatable; default: all)")
    parser.add_argument("--composite", default=None, help="only this composite, e.g. functional")
    parser.add_argument("--status", default=None, choices=STATUSES,
                        help=f"only entries with this status: {', '.join(STATUSES)} (with --failing: native's)")
    parser.add_argument("--failing", action="store_true",
                        help="list the cells where native is slow, errs or mismatches, and what auto chooses there")
    parser.add_argument("--png", type=arguments.png, help="write a heatmap PNG here (the folder must exist)")
    arguments.add_json(parser, "the entries (or, with --failing, the cells and choices)")
    parser.set_defaults(run=run)
