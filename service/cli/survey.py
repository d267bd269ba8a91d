"""``multicomposite survey``: OpInfo's op_db under the matrix's stacks, natively and inside use(); rows go to the
store as each job finishes (an interrupted survey keeps what it measured)."""

from __future__ import annotations

import argparse

from service import cli_output as out
from service.cli import arguments
from service.cli_output import UsageError


def run(args: argparse.Namespace) -> int:
    import os

    from registry.harness import survey
    from registry.store.evidence_store import EvidenceStore
    from registry.store.survey import write_survey

    try:
        stacks = tuple(dict.fromkeys(survey.normalize_stack(s) for s in args.stack)) if args.stack else None
        if args.limit_samples < 0:
            raise survey.SurveyError(f"--limit-samples must be 0 (every sample) or more, got {args.limit_samples}")
        entries = survey.select_entries(survey.op_db(), args.op)
        config = survey.SurveyConfig(stacks=stacks or survey.SURVEY_STACKS, limit_samples=args.limit_samples,
                                     case_timeout_s=args.timeout)
        workers = args.workers if args.workers is not None else min(2, os.cpu_count() or 1)
        store = EvidenceStore()
        try:
            with out.progress("survey", "jobs") as progress:
                def save(rows: list, done: int, total: int) -> None:
                    write_survey(store, rows)  # per job: an interrupted survey keeps what it measured
                    progress(done, total, rows[0].op if rows else "")

                run = survey.run_survey(entries, args.dtype or list(survey.DTYPES), config,
                                        workers=workers if len(entries) > 1 else 0, on_rows=save)
        finally:
            store.close()
    except survey.SurveyError as error:
        raise UsageError(str(error)) from None
    summary = survey.summarize(run.rows)
    if args.json:
        out.print_json({"seconds": round(run.seconds, 1), "summary": summary,
                        "rows": [row.as_dict() for row in run.rows]})
        return 0
    for line in survey.format_rows(run.rows, config.stacks):
        print(line)
    print(survey.format_summary(summary))
    print(f"{len(run.rows)} rows for {run.entries} op_db entries in {run.seconds:.0f} s, written to {store.url}")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", help="an op_db entry, 'add' or 'scatter_reduce.prod' (repeatable; "
                        "default: all)")
    parser.add_argument("--stack", action="append", help="vmap, grad, vmap(grad), jacrev, jacfwd, vmap(jvp) "
                        "(repeatable; default: all of these), or the depth-3 grad(vmap(grad)), vmap(grad(grad)), "
                        "jacrev(vmap(grad)), run where named")
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"),
                        help="float32 or float64 (repeatable; default: both)")
    parser.add_argument("--limit-samples", type=int, default=25,
                        help="OpInfo samples per entry and dtype (default 25; 0: every sample, any size)")
    parser.add_argument("--timeout", type=arguments.positive_seconds, default=20.0,
                        help="seconds per case (default 20)")
    parser.add_argument("--workers", type=arguments.non_negative_int, default=None,
                        help="forked worker processes (default: 2; 0: none, run in this process)")
    arguments.add_json(parser, "the rows and the summary")
    parser.set_defaults(run=run)
