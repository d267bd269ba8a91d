"""The ``multicomposite`` command line."""

from __future__ import annotations

import argparse
import json
import sys

import registry


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.main import create_app
    from service.settings import Settings

    settings = Settings()
    host = args.host or settings.host
    port = args.port or settings.port
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
    return 0


def _select(args: argparse.Namespace) -> int:
    try:
        decision = registry.select(args.op, stack=args.stack, batched=[b for b in args.batched.split(",") if b],
                                   dtype=args.dtype, policy=args.policy)
    except registry.SelectionError as error:
        print(f"multicomposite select: {error}", file=sys.stderr)
        return 2
    print(json.dumps({
        "op": decision.op, "composite": decision.composite, "kind": decision.kind, "reason": decision.reason,
        "alternatives": [vars(v) for v in decision.alternatives],
    }, indent=2))
    return 0


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]:60s}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _claim_failures(entries) -> list:
    """Built-in non-native composites that mismatch or err where the rules say they work."""
    from registry.core import rules
    from registry.core.context import Context

    failures = []
    for entry in entries:
        if entry.kind == "native" or entry.status not in ("mismatch", "error"):
            continue
        ctx = Context(stack=entry.stack, tensors=registry.OPS[entry.op].tensor_args)
        if rules.problem(entry.op, entry.kind, ctx) is None:
            failures.append(entry)
    return failures


def _verify(args: argparse.Namespace) -> int:
    import time

    import torch

    from registry.harness.verify import verify
    from registry.store import evidence
    from registry.store.db import Store

    dtypes = [getattr(torch, name) for name in (args.dtype or ["float32", "float64"])]
    try:
        start = time.perf_counter()
        entries = verify(ops=args.op or None, stacks=args.stack or None, dtypes=dtypes,
                         progress=None if args.json else _progress)
        elapsed = time.perf_counter() - start
    except (registry.SelectionError, ValueError, KeyError) as error:
        print(f"multicomposite verify: {error}", file=sys.stderr)
        return 2
    store = Store()
    store.write_entries(entries)
    store.close()
    evidence.use_loader(None)  # the next decision reads the fresh store
    failures = _claim_failures(entries)
    if args.json:
        print(json.dumps([{**vars(e), "stack": list(e.stack)} for e in entries], indent=1))
    else:
        _print_table(entries)
        print(f"{len(entries)} entries in {elapsed:.0f} s, written to {store.url}")
        for entry in failures:
            print(f"FAIL {entry.op}/{entry.composite} {','.join(entry.stack)} {entry.pattern} {entry.dtype}: "
                  f"{entry.status} {entry.detail}")
    return 1 if failures else 0


def _print_table(entries) -> None:
    """ops x stacks: the composite auto chooses there (all patterns batched) and its worst status."""
    from registry.reports.plots import stack_label
    from registry.store import evidence

    evidence.set_entries(entries)
    stacks = sorted({e.stack for e in entries}, key=lambda s: (len(s), s))
    ops = list(dict.fromkeys(e.op for e in entries))
    worst: dict[tuple[str, str, tuple[str, ...]], str] = {}
    order = ("ok", "unsupported", "slow", "mismatch", "error")
    for e in entries:
        key = (e.op, e.composite, e.stack)
        if order.index(e.status) > order.index(worst.get(key, "ok")):
            worst[key] = e.status
        worst.setdefault(key, e.status)
    for stack in stacks:
        cells = []
        for op in ops:
            batched = registry.OPS[op].tensor_args if "vmap" in stack else ()
            try:
                decision = registry.select(op, stack=stack, batched=batched)
                cells.append(f"{op}={decision.composite}[{worst.get((op, decision.composite, stack), '?')}]")
            except registry.SelectionError:
                cells.append(f"{op}=none")
        print(f"{stack_label(stack):28s} " + " ".join(cells))
    evidence.use_loader(None)


def _matrix(args: argparse.Namespace) -> int:
    import torch

    from registry.harness.verify import source_hashes
    from registry.reports.plots import render_matrix_png
    from registry.store.db import Store

    store = Store()
    entries = store.fresh_entries(source_hashes=source_hashes(), torch_version=torch.__version__)
    store.close()
    if args.op:
        entries = [e for e in entries if e.op in args.op]
    if not entries:
        print("multicomposite matrix: the store has no fresh entries; run `multicomposite verify` first",
              file=sys.stderr)
        return 2
    if args.png:
        print(f"wrote {render_matrix_png(entries, args.png)} ({len(entries)} entries)")
    else:
        for e in entries:
            print(f"{e.op}\t{e.composite}\t{','.join(e.stack)}\t{e.pattern}\t{e.dtype}\t{e.status}\t{e.detail}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import math
    import time

    import torch

    from registry.profiling.timing import profile
    from registry.store import evidence
    from registry.store.db import Store

    try:
        dtypes = [getattr(torch, name) for name in (args.dtype or ["float32"])]
        start = time.perf_counter()
        entries = profile(ops=args.op or None, workloads=args.stack or None, batch_sizes=args.batch or (1, 32, 256),
                          dtypes=dtypes, device=args.device, min_run_time=args.min_run_time, progress=_progress)
        elapsed = time.perf_counter() - start
    except (ValueError, KeyError, AttributeError) as error:
        print(f"multicomposite profile: {error}", file=sys.stderr)
        return 2
    store = Store()
    store.write_profiles(entries)
    store.close()
    evidence.use_profile_loader(None)
    native = {(e.op, e.workload, e.numel_bucket, e.batch_size, e.dtype): e.median_us
              for e in entries if e.kind == "native" and e.valid}
    print(f"{'op':15s} {'workload':11s} {'batch':>5s} {'composite':11s} {'median us':>10s} {'IQR us':>9s} "
          f"{'vs native':>9s}")
    for e in entries:
        base = native.get((e.op, e.workload, e.numel_bucket, e.batch_size, e.dtype))
        if not e.valid:
            print(f"{e.op:15s} {e.workload:11s} {e.batch_size:5d} {e.composite:11s} invalid: {e.detail[:60]}")
            continue
        ratio = f"{base / e.median_us:8.2f}x" if base else "        -"
        print(f"{e.op:15s} {e.workload:11s} {e.batch_size:5d} {e.composite:11s} {e.median_us:10.1f} {e.iqr_us:9.1f} "
              f"{ratio}")
    valid = [e for e in entries if e.valid]
    print(f"{len(entries)} profiles ({len(valid)} timed) in {elapsed:.0f} s, written to {store.url}")
    return 0 if not math.isnan(elapsed) else 1


def _report(args: argparse.Namespace) -> int:
    import torch

    from registry.harness.verify import source_hashes
    from registry.reports.plots import remeasured, render_speedups_png, speedup_lines
    from registry.store.db import Store

    store = Store()
    profiles = store.fresh_profiles(source_hashes=source_hashes(), torch_version=torch.__version__)
    store.close()
    if not profiles:
        print("multicomposite report: the store has no fresh profiles; run `multicomposite profile` first",
              file=sys.stderr)
        return 2
    print(f"wrote {render_speedups_png(profiles, args.png)} ({len(profiles)} profiles; error bars: median +- IQR/2)")
    for line in speedup_lines(profiles):
        print(line)
    again = remeasured(profiles)
    print(f"re-measured (the first run was disturbed): {len(again) or 'none'}")
    for line in again:
        print(f"  {line}")
    return 0


def _survey(args: argparse.Namespace) -> int:
    """OpInfo's op_db under the matrix's stacks, natively and inside use(); rows go to the store."""
    import os

    from registry.harness import survey
    from registry.store.db import Store
    from registry.store.survey import write_survey

    try:
        stacks = tuple(dict.fromkeys(survey.normalize_stack(s) for s in args.stack)) if args.stack else None
        if args.limit_samples < 1:
            raise survey.SurveyError(f"--limit-samples must be at least 1, got {args.limit_samples}")
        entries = survey.select_entries(survey.op_db(), args.op)
        config = survey.SurveyConfig(stacks=stacks or survey.SURVEY_STACKS, limit_samples=args.limit_samples,
                                     case_timeout_s=args.timeout)
        workers = args.workers if args.workers is not None else min(2, os.cpu_count() or 1)
        store = Store()
        try:
            def save(rows: list, done: int, total: int) -> None:
                write_survey(store, rows)  # per job: an interrupted survey keeps what it measured
                if not args.json:
                    _progress(done, total, rows[0].op if rows else "")

            run = survey.run_survey(entries, args.dtype or list(survey.DTYPES), config,
                                    workers=workers if len(entries) > 1 else 0, on_rows=save)
        finally:
            store.close()
    except survey.SurveyError as error:
        print(f"multicomposite survey: {error}", file=sys.stderr)
        return 2
    summary = survey.summarize(run.rows)
    if args.json:
        print(json.dumps({"seconds": round(run.seconds, 1), "summary": summary,
                          "rows": [row.as_dict() for row in run.rows]}, indent=1))
        return 0
    for line in survey.format_rows(run.rows, config.stacks):
        print(line)
    print(survey.format_summary(summary))
    print(f"{len(run.rows)} rows for {run.entries} op_db entries in {run.seconds:.0f} s, written to {store.url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multicomposite", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default=None, help="default: MULTICOMPOSITE_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: MULTICOMPOSITE_PORT or 8000")
    serve.set_defaults(run=_serve)
    select = commands.add_parser("select", help="print the decision for an op under a stack")
    select.add_argument("op")
    select.add_argument("--stack", default="")
    select.add_argument("--batched", default="")
    select.add_argument("--dtype", default=None)
    select.add_argument("--policy", default="auto")
    select.set_defaults(run=_select)
    verify = commands.add_parser("verify", help="verify every composite under every stack; fill the store")
    verify.add_argument("--op", action="append", help="an op to verify (repeatable; default: all)")
    verify.add_argument("--stack", action="append", help="a stack such as vmap,grad (repeatable; default: all)")
    verify.add_argument("--dtype", action="append", help="float32, float64 (repeatable; default: both)")
    verify.add_argument("--json", action="store_true", help="print the entries as JSON")
    verify.set_defaults(run=_verify)
    matrix = commands.add_parser("matrix", help="show the stored matrix, or render it with --png FILE")
    matrix.add_argument("--op", action="append")
    matrix.add_argument("--png", help="write a heatmap PNG here")
    matrix.set_defaults(run=_matrix)
    prof = commands.add_parser("profile", help="time every composite side by side with native; fill the store")
    prof.add_argument("--op", action="append")
    prof.add_argument("--stack", action="append", help="vmap, grad, vmap(grad), jacrev, jacfwd, hessian")
    prof.add_argument("--batch", action="append", type=int)
    prof.add_argument("--dtype", action="append")
    prof.add_argument("--device", default="cpu")
    prof.add_argument("--min-run-time", type=float, default=0.1)
    prof.set_defaults(run=_profile)
    report = commands.add_parser("report", help="plot the speedup over native per op and stack")
    report.add_argument("--png", required=True)
    report.set_defaults(run=_report)
    survey = commands.add_parser("survey", help="run OpInfo's op_db under the stacks, natively and inside use()")
    survey.add_argument("--op", action="append", help="an op_db entry, 'add' or 'scatter_reduce.prod' (repeatable; "
                        "default: all)")
    survey.add_argument("--stack", action="append", help="vmap, grad, vmap(grad), jacrev, jacfwd, vmap(jvp) "
                        "(repeatable; default: all)")
    survey.add_argument("--dtype", action="append", choices=("float32", "float64"), help="default: both")
    survey.add_argument("--limit-samples", type=int, default=2, help="OpInfo samples per entry and dtype (default 2)")
    survey.add_argument("--timeout", type=float, default=20.0, help="seconds per case (default 20)")
    survey.add_argument("--workers", type=int, default=None, help="forked worker processes (default: 2, 0: none)")
    survey.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    survey.set_defaults(run=_survey)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
