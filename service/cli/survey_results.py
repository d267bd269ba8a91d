"""``multicomposite survey-results``: the stored survey rows for this torch, filtered."""

from __future__ import annotations

import argparse

from service import cli_output as out
from service.cli import arguments
from service.cli.store import open_store
from service.cli_output import UsageError

COLUMNS = ("op", "stack", "batching", "dtype", "native_status", "use_status", "max_abs_error", "samples")


def run(args: argparse.Namespace) -> int:
    import torch

    from registry.harness import survey
    from registry.store.survey import survey_rows

    try:
        stacks = {survey.normalize_stack(s) for s in args.stack} if args.stack else None
    except survey.SurveyError as error:
        raise UsageError(str(error)) from None
    store = open_store()
    try:
        rows = survey_rows(store, torch_version=torch.__version__)
    finally:
        store.close()
    rows = [r for r in rows if (not args.op or r["op"] in args.op) and (stacks is None or r["stack"] in stacks)
            and (not args.misbehaving or r["native_status"] in survey.MISBEHAVING)]
    if args.json:
        out.print_json(rows)
        return 0
    out.print_table((*COLUMNS, "detail"),
                    [(*(r[c] for c in COLUMNS), r["native_detail"] or r["use_detail"]) for r in rows])
    print(f"{len(rows)} survey rows for torch {torch.__version__}")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", help="only this op_db entry, e.g. add (repeatable; default: all)")
    parser.add_argument("--stack", action="append", help="only this stack: vmap, grad, vmap(grad), jacrev, jacfwd, "
                        "vmap(jvp) (repeatable; default: all)")
    parser.add_argument("--misbehaving", action="store_true",
                        help="only rows where native is slow, errs or mismatches")
    arguments.add_json(parser, "the stored survey rows")
    parser.set_defaults(run=run)
