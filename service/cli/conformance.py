"""``multicomposite conformance [--op OP ...]``: the conformance suite (registry/harness/conformance.py) over the
covered ops, natively and inside ``use()``; rows go to the store's ``conformance_results`` table as each job
finishes.

Exit codes: 0 when no check that passes natively fails inside ``use()``; 1 when one does; 2 bad input.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from service import cli_output as out
from service.cli import arguments
from service.cli_output import UsageError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=arguments.op,
                        help="a covered op, e.g. take or batch_norm (repeatable; default: "
                        "every covered op)")
    parser.add_argument("--check", action="append", help="vjp, jvp, vmap, vmap(vjp), vjp(vmap), vmap(jvp), "
                        "jvp(vjp), the depth-3 vjp(vmap(vjp)), vmap(vjp(vjp)), jacrev(vmap(vjp)), or "
                        "'no fallback warning' (repeatable; default: all)")
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"),
                        help="float32 or float64 (repeatable; default: both)")
    parser.add_argument("--limit-samples", type=arguments.non_negative_int, default=0,
                        help="OpInfo samples per entry and dtype (default 0: every sample)")
    parser.add_argument("--workers", type=arguments.non_negative_int, default=None,
                        help="forked worker processes (default: 2; 0: none, run in this process)")
    arguments.add_json(parser, "the rows and the totals")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from registry.harness import conformance
    from registry.store.conformance import write_conformance
    from registry.store.evidence_store import EvidenceStore

    try:
        checks = conformance.parse_checks(args.check)
        jobs = conformance.covered_entries(args.op)
        config = conformance.ConformanceConfig(checks=checks, sample_limit=args.limit_samples)
        workers = args.workers if args.workers is not None else min(2, os.cpu_count() or 1)
        store = EvidenceStore()
        try:
            with out.progress("conformance", "jobs") as progress:
                def save(rows: list[Any], done: int, total: int) -> None:
                    write_conformance(store, rows)  # per job: an interrupted run keeps what it measured
                    progress(done, total, rows[0].entry if rows else "")

                run = conformance.run_conformance(jobs, args.dtype or ["float32", "float64"], config,
                                                  workers=workers if len(jobs) > 1 else 0, on_rows=save)
        finally:
            store.close()
    except conformance.ConformanceError as error:
        raise UsageError(str(error)) from None
    summary = conformance.totals(run.rows)
    if args.json:
        out.print_json({"seconds": round(run.seconds, 1), "totals": summary,
                        "rows": [row.as_dict() for row in run.rows]})
    else:
        for line in conformance.format_totals(summary):
            print(line)
        print(f"{len(run.rows)} rows in {run.seconds:.0f} s, written to {store.url}")
    return 1 if summary["overall"]["newly_failing"] else 0
