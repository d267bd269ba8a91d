"""``multicomposite verify``: every composite under every stack, against PyTorch's own op; the entries go to the
store. Exit code 1 when a built-in composite fails where the rules say it works."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from service import cli_output as out
from service.cli import arguments
from service.cli.store import entry_json, open_store
from service.cli_output import UsageError

if TYPE_CHECKING:
    from registry.store.records import MatrixEntry

# The stacks whose choice the summary shows when no --stack narrows it: the batched ones every op is verified
# under (OpInfo ops run vmap, grad, vmap(grad) and vmap(jvp); the seed ops every nesting).
SUMMARY_STACKS: tuple[tuple[str, ...], ...] = (("vmap",), ("vmap", "grad"), ("vmap", "jvp"))
VERIFY_STATUSES = ("ok", "slow", "mismatch", "error", "unsupported")


def choices_table(entries: Sequence[MatrixEntry],
                  stacks: Sequence[tuple[str, ...]] | None = None) -> tuple[list[str], list[list[str]]]:
    """One row per op: its entries by status, and under each of ``stacks`` (default: those of SUMMARY_STACKS that
    were run) the composite auto chooses with self batched, with its worst status there. One row per op rather than
    one column: the whole set is ~90 ops and 63 stacks."""
    from registry.core.status import RANK  # "unsupported" mildest: a pattern with nothing to batch hides nothing
    from registry.reports.plots import stack_label
    from registry.store.choices import choices_by_op

    run_stacks = {e.stack for e in entries}
    shown = [s for s in (stacks or SUMMARY_STACKS) if s in run_stacks]
    counts: dict[str, Counter[str]] = {}
    for e in entries:
        counts.setdefault(e.op, Counter())[e.status] += 1
    choices = choices_by_op(entries, shown, RANK)
    rows = []
    for op, by_status in counts.items():
        cells = [op, str(sum(by_status.values())), *(str(by_status[status]) for status in VERIFY_STATUSES)]
        for stack in shown:
            choice = choices[op][stack]
            cells.append(f"{choice[0]} [{choice[1]}]" if choice is not None else "none")
        rows.append(cells)
    return ["op", "entries", *VERIFY_STATUSES, *(stack_label(s) for s in shown)], rows


def run(args: argparse.Namespace) -> int:
    # The bar first: loading the harness (OpInfo, the samples) and the first entries take seconds.
    with out.progress("verify", "entries") as progress:
        import torch

        import registry
        from registry.core.stacks import format_stack
        from registry.harness.claims import claim_failures
        from registry.harness.stored_verify import verify_into

        dtypes = [getattr(torch, name) for name in (args.dtype or ["float32", "float64"])]  # names from RUN_DTYPES
        store = open_store()
        try:
            start = time.perf_counter()
            # Written when done (running servers reload within a second); this process's next decision reads them.
            entries = verify_into(store, ops=args.op or None,
                                  stacks=[list(s) for s in args.stack] if args.stack else None, dtypes=dtypes,
                                  progress=progress)
            elapsed = time.perf_counter() - start
        except KeyboardInterrupt:
            raise KeyboardInterrupt("nothing of this run was stored") from None
        except (registry.SelectionError, ValueError, KeyError) as error:
            raise UsageError(str(error)) from None
        finally:
            store.close()
    failures = claim_failures(entries)
    if args.json:
        out.print_json([entry_json(e) for e in entries])
    else:
        columns, rows = choices_table(entries, [tuple(s) for s in args.stack] if args.stack else None)
        out.print_table(columns, rows, title="entries by status; under each stack, the composite auto chooses "
                        "with self batched [its worst status there]")
        print(f"{len(entries)} entries in {elapsed:.0f} s, written to {store.url}")
        for entry in failures:
            print(f"FAIL {entry.op}/{entry.composite} {format_stack(entry.stack) or 'eager'} {entry.pattern} "
                  f"{entry.dtype}: {entry.status} {entry.detail}")
    return 1 if failures else 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=arguments.op, help="an op to verify (repeatable; default: all)")
    parser.add_argument("--stack", action="append", type=arguments.stack,
                        help="a stack such as vmap(grad) or vmap,grad (repeatable; default: all)")
    parser.add_argument("--dtype", action="append", type=arguments.run_dtype,
                        help=f"{', '.join(arguments.RUN_DTYPES)} (repeatable; default: float32 and float64)")
    arguments.add_json(parser, "the entries")
    parser.set_defaults(run=run)
