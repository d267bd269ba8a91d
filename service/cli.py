"""The ``multicomposite`` command line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import registry
from registry.core.stacks import canonical_workload, format_stack, parse_bounded_stack, shorten
from service.worker import add_worker_command

if TYPE_CHECKING:
    from registry.store.db import Store

# The dtypes verify and profile run: the floating point ones the samples are written for.
RUN_DTYPES = ("float32", "float64", "float16", "bfloat16")


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _dtype(text: str) -> str:
    if text not in RUN_DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {shorten(text)!r}; choose from {', '.join(RUN_DTYPES)}")
    return text


def _any_dtype(text: str) -> str:
    from service.validation import InputError, parse_dtype

    try:
        parse_dtype(text)  # a fixed table: an unknown name never reaches getattr(torch, ...)
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{shorten(text)!r} is not a positive whole number")
    return value


def _stack(text: str) -> tuple[str, ...]:
    try:
        return parse_bounded_stack(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _workload(text: str) -> str:
    from registry.profiling.timing import WORKLOADS

    try:
        workload = canonical_workload(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if workload not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {shorten(text)!r}; workloads are {', '.join(WORKLOADS)}")
    return workload


def _device(text: str) -> str:
    from service.validation import InputError, host_device_types, parse_device

    try:
        parse_device(text, host_device_types())
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _op(text: str) -> str:
    from registry.core.selector import unknown_op_message

    registry.load()
    if text not in registry.OPS:
        raise argparse.ArgumentTypeError(unknown_op_message(text))
    return text


def _png(text: str) -> Path:
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {shorten(path.parent, 80)} does not exist; create it, or "
                                         "write the PNG elsewhere")
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{shorten(path.name)!r} does not end in .png")
    return path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from registry.store.db import StoreUnavailableError
    from service.main import create_app
    from service.settings import SettingsError, load_settings
    from service.state import StoreState

    try:
        settings = load_settings(host=args.host, port=args.port)
        probe = StoreState(settings.db, settings.evidence_poll_s, 1)
        probe.open()  # an unreachable store refuses the start here, in one line, not in a traceback
        probe.close()
    except (SettingsError, StoreUnavailableError) as error:
        raise UsageError(str(error)) from None
    # uvloop and httptools when installed (they are dependencies): the throughput the README reports is theirs.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "auto"
    http = "httptools" if importlib.util.find_spec("httptools") else "auto"
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info", access_log=False,
                loop=loop, http=http)
    return 0


def _select(args: argparse.Namespace) -> int:
    try:
        decision = registry.select(args.op, stack=args.stack, batched=[b for b in args.batched.split(",") if b],
                                   dtype=args.dtype, policy=args.policy)
    except registry.SelectionError as error:
        raise UsageError(str(error)) from None
    print(json.dumps({
        "op": decision.op, "stack": format_stack(decision.context.stack), "composite": decision.composite,
        "kind": decision.kind, "reason": decision.reason, "speedup": decision.speedup,
        "runner_up_speedup": decision.runner_up_speedup, "alternatives": [vars(v) for v in decision.alternatives],
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
    from registry.store.benchlock import recorded_run

    dtypes = [getattr(torch, name) for name in (args.dtype or ["float32", "float64"])]  # names from RUN_DTYPES
    store = _open_store()
    try:
        start = time.perf_counter()
        with recorded_run(store, "verify"):
            entries = verify(ops=args.op or None, stacks=[list(s) for s in args.stack] if args.stack else None,
                             dtypes=dtypes, progress=None if args.json else _progress)
        elapsed = time.perf_counter() - start
    except (registry.SelectionError, ValueError, KeyError) as error:
        raise UsageError(str(error)) from None
    store.write_entries(entries)  # bumps the store's generation: running servers reload within a second
    store.close()
    evidence.use_loader(None)  # the next decision reads the fresh store
    failures = _claim_failures(entries)
    if args.json:
        print(json.dumps([{**vars(e), "stack": format_stack(e.stack)} for e in entries], indent=1))
    else:
        _print_table(entries)
        print(f"{len(entries)} entries in {elapsed:.0f} s, written to {store.url}")
        for entry in failures:
            print(f"FAIL {entry.op}/{entry.composite} {format_stack(entry.stack) or 'eager'} {entry.pattern} "
                  f"{entry.dtype}: {entry.status} {entry.detail}")
    return 1 if failures else 0


def _open_store() -> Store:
    """The default store, checked; UsageError (one line) when it cannot be opened."""
    from registry.store.db import Store, StoreUnavailableError

    try:
        store = Store()
        store.check()
    except StoreUnavailableError as error:
        raise UsageError(str(error)) from None
    except Exception as error:  # a driver error opening it: the same answer, in one line
        first = (str(error).strip().splitlines() or [""])[0]
        raise UsageError(f"the store cannot be opened: {type(error).__name__}: {first}; check MULTICOMPOSITE_DB"
                         ) from None
    return store


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

    store = _open_store()
    entries = store.fresh_entries(source_hashes=source_hashes(), torch_version=torch.__version__)
    store.close()
    if args.op:
        entries = [e for e in entries if e.op in args.op]
    if not entries:
        raise UsageError("the store has no fresh entries; run `multicomposite verify` first")
    if args.png:
        print(f"wrote {render_matrix_png(entries, args.png)} ({len(entries)} entries)")
    else:
        for e in entries:
            stack = format_stack(e.stack) or "eager"
            print(f"{e.op}\t{e.composite}\t{stack}\t{e.pattern}\t{e.dtype}\t{e.status}\t{e.detail}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import math
    import time

    import torch

    from registry.profiling.timing import profile
    from registry.store import evidence
    from registry.store.benchlock import timed_run

    def waiting(holder: str, path) -> None:
        print(f"multicomposite profile: waiting for the benchmark of pid {holder} to finish ({path})",
              file=sys.stderr)

    store = _open_store()
    dtypes = [getattr(torch, name) for name in (args.dtype or ["float32"])]  # names from RUN_DTYPES
    try:
        start = time.perf_counter()
        entries = timed_run(store, "profile", lambda: profile(
            ops=args.op or None, workloads=args.stack or None, batch_sizes=args.batch or (1, 32, 256),
            dtypes=dtypes, device=args.device, min_run_time=args.min_run_time, progress=_progress), on_wait=waiting)
        elapsed = time.perf_counter() - start
    except (ValueError, KeyError) as error:
        raise UsageError(str(error)) from None
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

    store = _open_store()
    profiles = store.fresh_profiles(source_hashes=source_hashes(), torch_version=torch.__version__)
    store.close()
    if not profiles:
        raise UsageError("the store has no fresh profiles; run `multicomposite profile` first")
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
    parser = _Parser(prog="multicomposite", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = commands.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default=None, help="default: MULTICOMPOSITE_HOST or 127.0.0.1")
    serve.add_argument("--port", type=_positive, default=None, help="default: MULTICOMPOSITE_PORT or 8000")
    serve.set_defaults(run=_serve)
    select = commands.add_parser("select", help="print the decision for an op under a stack")
    select.add_argument("op")
    select.add_argument("--stack", default="", help="vmap(grad) or vmap,grad")
    select.add_argument("--batched", default="")
    select.add_argument("--dtype", default=None, type=_any_dtype)
    select.add_argument("--policy", default="auto", choices=registry.POLICIES)
    select.set_defaults(run=_select)
    verify = commands.add_parser("verify", help="verify every composite under every stack; fill the store")
    verify.add_argument("--op", action="append", type=_op, help="an op to verify (repeatable; default: all)")
    verify.add_argument("--stack", action="append", type=_stack,
                        help="a stack such as vmap(grad) or vmap,grad (repeatable; default: all)")
    verify.add_argument("--dtype", action="append", type=_dtype,
                        help=f"{', '.join(RUN_DTYPES)} (repeatable; default: float32 and float64)")
    verify.add_argument("--json", action="store_true", help="print the entries as JSON")
    verify.set_defaults(run=_verify)
    matrix = commands.add_parser("matrix", help="show the stored matrix, or render it with --png FILE")
    matrix.add_argument("--op", action="append", type=_op)
    matrix.add_argument("--png", type=_png, help="write a heatmap PNG here (the folder must exist)")
    matrix.set_defaults(run=_matrix)
    prof = commands.add_parser("profile", help="time every composite side by side with native; fill the store")
    prof.add_argument("--op", action="append", type=_op)
    prof.add_argument("--stack", action="append", type=_workload,
                      help="vmap, grad, vmap(grad) (or vmap,grad), jacrev, jacfwd, hessian")
    prof.add_argument("--batch", action="append", type=_positive)
    prof.add_argument("--dtype", action="append", type=_dtype)
    prof.add_argument("--device", default="cpu", type=_device, help="a device this host has: cpu, cuda, cuda:1")
    prof.add_argument("--min-run-time", type=float, default=0.1)
    prof.set_defaults(run=_profile)
    report = commands.add_parser("report", help="plot the speedup over native per op and stack")
    report.add_argument("--png", required=True, type=_png)
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
    from service.db_commands import add_db_command

    add_db_command(commands)  # db upgrade, db current (service/db_commands.py)
    add_worker_command(commands)  # `multicomposite worker`: service/worker.py
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as error:
        print(f"multicomposite {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
