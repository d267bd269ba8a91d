"""The ``multicomposite`` command line.

Each subcommand is one row of SUBCOMMANDS: its name, its help, a ``configure(parser)`` that adds its arguments and
sets ``run`` (``parser.set_defaults(run=...)``, a function of the parsed arguments returning the exit code), and
whether it only reads (a read command takes ``--json``; a test checks it). Adding a subcommand is one row here and a
``configure`` function, which may live in its own module; such a module raises ``service.cli_output.UsageError``
for bad input (one line on stderr, exit 2) and writes through ``service.cli_output`` (tables, JSON, progress).

Exit codes: 0 done; 1 done, but what ran found a failure (``verify``); 2 bad input, said in one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import registry
from registry.core.stacks import canonical_workload, format_stack, parse_bounded_stack, shorten
from service import cli_output as out
from service.cli_output import UsageError

if TYPE_CHECKING:
    from registry.store.db import MatrixEntry, ProfileEntry, Store

# The dtypes verify and profile run: the floating point ones the samples are written for.
RUN_DTYPES = ("float32", "float64", "float16", "bfloat16")


class _ParserExit(Exception):  # noqa: N818 -- a way out of argparse, not a failure
    """argparse finished early: ``--help`` (code 0) or a usage error, already printed (code 2)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise _ParserExit(2)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _ParserExit(status)


# --- argument types: each turns bad text into one line saying what is valid -----------------------------------------


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
    return text.removeprefix("torch.")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{shorten(text)!r} is not a positive whole number")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{shorten(text)!r} is not a positive number of seconds")
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
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{shorten(path, 80)} is a folder; name a PNG file inside it")
    return path


def _add_json(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true",
                        help=f"print {what} as one JSON document on stdout, and nothing else there")


# --- the store -------------------------------------------------------------------------------------------------------


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


def _fresh(store: Store, *, entries: bool = True,
           profiles: bool = True) -> tuple[list[MatrixEntry], list[ProfileEntry]]:
    """The matrix entries and profiles still valid for this torch and these composites' sources; a table not
    asked for is not read (an empty list)."""
    import torch

    from registry.core.sources import source_hashes

    hashes = source_hashes()
    return (store.fresh_entries(source_hashes=hashes, torch_version=torch.__version__) if entries else [],
            store.fresh_profiles(source_hashes=hashes, torch_version=torch.__version__) if profiles else [])


def _entry_json(entry: Any) -> dict[str, Any]:
    return {**vars(entry), "stack": format_stack(entry.stack)}


# --- serve -----------------------------------------------------------------------------------------------------------


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


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="the address to listen on (default: MULTICOMPOSITE_HOST or "
                        "127.0.0.1)")
    parser.add_argument("--port", type=_positive, default=None, help="the port to listen on (default: "
                        "MULTICOMPOSITE_PORT or 8000)")
    parser.set_defaults(run=_serve)


# --- ops -------------------------------------------------------------------------------------------------------------


def _ops(args: argparse.Namespace) -> int:
    registry.load()
    names = args.op or list(registry.OPS)
    listed = [{"name": name, "doc": registry.OPS[name].doc, "tensor_args": list(registry.OPS[name].tensor_args),
               "entry_points": list(registry.OPS[name].qualified_entry_points),
               "composites": [{"name": c.name, "kind": c.kind, "doc": c.doc}
                              for c in registry.composites(name).values()]}
              for name in names]
    if args.json:
        out.print_json(listed)
        return 0
    out.print_table(("op", "composite", "kind", "doc"),
                    [(op["name"], c["name"], c["kind"], c["doc"]) for op in listed for c in op["composites"]])
    return 0


def _configure_ops(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=_op, help="only this op (repeatable; default: every covered op)")
    _add_json(parser, "the ops, their tensor arguments, entry points and composites")
    parser.set_defaults(run=_ops)


# --- select ----------------------------------------------------------------------------------------------------------


def _select(args: argparse.Namespace) -> int:
    import torch

    from service.validation import InputError, check_dtype_under_stack, parse_device

    try:
        check_dtype_under_stack(getattr(torch, args.dtype) if args.dtype else None, args.stack)
        device = parse_device(args.device, (args.device.split(":")[0],)) if args.device else None
        decision = registry.select(args.op, stack=args.stack, batched=[b for b in args.batched.split(",") if b],
                                   dtype=args.dtype, device=device, numel=args.numel, policy=args.policy,
                                   pins={args.op: args.pin} if args.pin else None)
    except (registry.SelectionError, InputError) as error:
        raise UsageError(str(error)) from None
    from service.models import DecisionPublic

    answer = DecisionPublic.of(decision).model_dump()
    if args.json:
        out.print_json(answer)
        return 0
    print(f"{answer['op']} under {answer['stack'] or 'no transform'}: {answer['composite']} ({answer['kind']})")
    print(f"reason: {answer['reason']}")
    if decision.speedup is not None:
        print(f"speedup over native: {decision.speedup:.2f}x")
    out.print_table(("alternative", "kind", "verdict", "why"),
                    [(v.composite, v.kind, "valid" if v.ok else "invalid", v.reason) for v in decision.alternatives])
    return 0


def _configure_select(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", type=_op, help="the op, e.g. index_fill (multicomposite ops lists them)")
    parser.add_argument("--stack", type=_stack, default=(), help="transforms, outermost first: vmap(grad) or "
                        "vmap,grad (default: none)")
    parser.add_argument("--batched", default="", help="comma-separated tensor arguments batched at the innermost "
                        "vmap, e.g. self,value")
    parser.add_argument("--dtype", default=None, type=_any_dtype, help="the arguments' dtype, e.g. float32")
    parser.add_argument("--device", default=None, type=_device, help="the device type: cpu, cuda")
    parser.add_argument("--numel", default=None, type=_positive, help="elements per sample (picks the profiled "
                        "size nearest to it)")
    parser.add_argument("--policy", default="auto", choices=registry.POLICIES,
                        help=f"how to choose: {', '.join(registry.POLICIES)} (default: auto)")
    parser.add_argument("--pin", default=None, help="force a kind or composite for this op, e.g. functional")
    _add_json(parser, "the decision")
    parser.set_defaults(run=_select)


# --- verify ----------------------------------------------------------------------------------------------------------


def _claim_failures(entries: Sequence[MatrixEntry]) -> list[MatrixEntry]:
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


# The stacks whose choice the verify summary shows when no --stack narrows it: the batched ones every op is verified
# under (OpInfo ops run vmap, grad, vmap(grad) and vmap(jvp); the seed ops every nesting).
SUMMARY_STACKS: tuple[tuple[str, ...], ...] = (("vmap",), ("vmap", "grad"), ("vmap", "jvp"))
VERIFY_STATUSES = ("ok", "slow", "mismatch", "error", "unsupported")


def _choices_table(entries: Sequence[MatrixEntry],
                   stacks: Sequence[tuple[str, ...]] | None = None) -> tuple[list[str], list[list[str]]]:
    """One row per op: its entries by status, and under each of ``stacks`` (default: those of SUMMARY_STACKS that
    were run) the composite auto chooses with the op's first tensor batched (the matrix's pattern ``self``, the usual
    vmap over data), with that composite's worst status in that pattern there. One row per op rather than one
    column: the whole set is ~90 ops and 63 stacks."""
    from registry.harness.survey import RANK  # "unsupported" mildest: a pattern with nothing to batch hides nothing
    from registry.reports.plots import stack_label
    from registry.store import evidence

    run_stacks = {e.stack for e in entries}
    shown = [s for s in (stacks or SUMMARY_STACKS) if s in run_stacks]
    evidence.set_entries(entries)
    try:
        worst: dict[tuple[str, str, tuple[str, ...]], str] = {}
        counts: dict[str, Counter[str]] = {}
        for e in entries:
            counts.setdefault(e.op, Counter())[e.status] += 1
            if "vmap" in e.stack and e.pattern != "self":
                continue
            key = (e.op, e.composite, e.stack)
            if key not in worst or RANK.index(e.status) > RANK.index(worst[key]):
                worst[key] = e.status
        rows = []
        for op, by_status in counts.items():
            cells = [op, str(sum(by_status.values())), *(str(by_status[status]) for status in VERIFY_STATUSES)]
            for stack in shown:
                batched = registry.OPS[op].tensor_args[:1] if "vmap" in stack else ()
                try:
                    decision = registry.select(op, stack=stack, batched=batched)
                    cells.append(f"{decision.composite} [{worst.get((op, decision.composite, stack), 'not run')}]")
                except registry.SelectionError:
                    cells.append("none")
            rows.append(cells)
    finally:
        evidence.use_loader(None)
    return ["op", "entries", *VERIFY_STATUSES, *(stack_label(s) for s in shown)], rows


def _verify(args: argparse.Namespace) -> int:
    import torch

    from registry.harness.verify import verify
    from registry.store import evidence
    from registry.store.benchlock import recorded_run

    dtypes = [getattr(torch, name) for name in (args.dtype or ["float32", "float64"])]  # names from RUN_DTYPES
    store = _open_store()
    try:
        start = time.perf_counter()
        with recorded_run(store, "verify"), out.progress("verify", "entries") as progress:
            entries = verify(ops=args.op or None, stacks=[list(s) for s in args.stack] if args.stack else None,
                             dtypes=dtypes, progress=progress)
        elapsed = time.perf_counter() - start
        store.write_entries(entries)  # bumps the store's generation: running servers reload within a second
    except (registry.SelectionError, ValueError, KeyError) as error:
        raise UsageError(str(error)) from None
    finally:
        store.close()
    evidence.use_loader(None)  # the next decision reads the fresh store
    failures = _claim_failures(entries)
    if args.json:
        out.print_json([_entry_json(e) for e in entries])
    else:
        columns, rows = _choices_table(entries, [tuple(s) for s in args.stack] if args.stack else None)
        out.print_table(columns, rows, title="entries by status; under each stack, the composite auto chooses "
                        "with self batched [its worst status there]")
        print(f"{len(entries)} entries in {elapsed:.0f} s, written to {store.url}")
        for entry in failures:
            print(f"FAIL {entry.op}/{entry.composite} {format_stack(entry.stack) or 'eager'} {entry.pattern} "
                  f"{entry.dtype}: {entry.status} {entry.detail}")
    return 1 if failures else 0


def _configure_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=_op, help="an op to verify (repeatable; default: all)")
    parser.add_argument("--stack", action="append", type=_stack,
                        help="a stack such as vmap(grad) or vmap,grad (repeatable; default: all)")
    parser.add_argument("--dtype", action="append", type=_dtype,
                        help=f"{', '.join(RUN_DTYPES)} (repeatable; default: float32 and float64)")
    _add_json(parser, "the entries")
    parser.set_defaults(run=_verify)


# --- matrix ----------------------------------------------------------------------------------------------------------


def _batched_for(op: str, pattern: str, stack: tuple[str, ...]) -> tuple[str, ...]:
    """The tensor arguments a matrix pattern batches: what the selector is asked for that cell."""
    if "vmap" not in stack:
        return ()
    tensor_args = registry.OPS[op].tensor_args
    if pattern == "self":
        return ("self",)
    if pattern == "others":
        return tuple(name for name in tensor_args if name != "self")
    return tensor_args  # all, in_dims1


def native_failures(entries: Sequence[MatrixEntry], profiles: Sequence[ProfileEntry] = ()) -> list[dict[str, Any]]:
    """Each cell where the native composite is slow, errs or mismatches, with the choice policy ``auto`` makes there
    on this evidence (``entries``, ``profiles``): composite, kind, its status in the same cell and the reason."""
    from registry.store import evidence
    from registry.store.evidence import FAILING

    status = {(e.op, e.composite, e.stack, e.pattern, e.dtype): e for e in entries}
    failing = [e for e in entries if e.kind == "native" and e.status in FAILING]
    evidence.set_entries(entries)
    evidence.set_profiles(profiles)
    rows = []
    try:
        for e in sorted(failing, key=lambda e: (e.op, len(e.stack), e.stack, e.pattern, e.dtype)):
            row = {"op": e.op, "stack": format_stack(e.stack), "pattern": e.pattern, "dtype": e.dtype,
                   "native_status": e.status, "native_detail": e.detail}
            try:
                decision = registry.select(e.op, stack=e.stack, batched=_batched_for(e.op, e.pattern, e.stack),
                                           dtype=e.dtype)
            except registry.SelectionError as error:
                rows.append({**row, "composite": None, "kind": None, "status": None, "reason": str(error)})
                continue
            there = status.get((e.op, decision.composite, e.stack, e.pattern, e.dtype))
            rows.append({**row, "composite": decision.composite, "kind": decision.kind,
                         "status": there.status if there is not None else "not verified",
                         "reason": decision.reason})
    finally:
        evidence.use_loader(None)
        evidence.use_profile_loader(None)
    return rows


def _matrix(args: argparse.Namespace) -> int:
    from registry.reports.plots import render_matrix_png

    if args.failing and args.png:
        raise UsageError("--failing lists cells; it has no PNG: drop --png, or --failing to render the matrix")
    store = _open_store()
    try:
        everything, profiles = _fresh(store, profiles=args.failing)  # only --failing ranks by the profiles
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
        out.print_json([_entry_json(e) for e in entries])
        return 0
    out.print_table(("op", "composite", "stack", "pattern", "dtype", "status", "detail"),
                    [(e.op, e.composite, format_stack(e.stack) or "eager", e.pattern, e.dtype, e.status, e.detail)
                     for e in entries])
    return 0


def _configure_matrix(parser: argparse.ArgumentParser) -> None:
    from registry.core.status import STATUSES

    parser.add_argument("--op", action="append", type=_op, help="only this op (repeatable; default: all)")
    parser.add_argument("--stack", action="append", type=_stack, help="only this stack, vmap(grad) or vmap,grad "
                        "(repeatable; default: all)")
    parser.add_argument("--composite", default=None, help="only this composite, e.g. functional")
    parser.add_argument("--status", default=None, choices=STATUSES,
                        help=f"only entries with this status: {', '.join(STATUSES)} (with --failing: native's)")
    parser.add_argument("--failing", action="store_true",
                        help="list the cells where native is slow, errs or mismatches, and what auto chooses there")
    parser.add_argument("--png", type=_png, help="write a heatmap PNG here (the folder must exist)")
    _add_json(parser, "the entries (or, with --failing, the cells and choices)")
    parser.set_defaults(run=_matrix)


# --- profiles, profile -----------------------------------------------------------------------------------------------


def _profile_rows(entries: Sequence[ProfileEntry]) -> list[tuple[object, ...]]:
    native = {(e.op, e.workload, e.numel_bucket, e.batch_size, e.dtype, e.device): e.median_us
              for e in entries if e.kind == "native" and e.valid}
    rows: list[tuple[object, ...]] = []
    for e in entries:
        base = native.get((e.op, e.workload, e.numel_bucket, e.batch_size, e.dtype, e.device))
        if not e.valid:
            rows.append((e.op, e.workload, e.dtype, e.batch_size, e.composite, None, None, None,
                         f"invalid: {e.detail}"))
            continue
        ratio = f"{base / e.median_us:.2f}x" if base and e.median_us else None
        rows.append((e.op, e.workload, e.dtype, e.batch_size, e.composite, f"{e.median_us:.1f}",
                     f"{e.iqr_us or 0.0:.1f}", ratio, e.detail))
    return rows


PROFILE_COLUMNS = ("op", "workload", "dtype", "batch", "composite", "median us", "IQR us", "vs native", "detail")


def _profiles(args: argparse.Namespace) -> int:
    store = _open_store()
    try:
        _, profiles = _fresh(store, entries=False)
    finally:
        store.close()
    shown = [p for p in profiles if (not args.op or p.op in args.op) and (not args.workload
             or p.workload in args.workload) and (args.dtype is None or p.dtype == args.dtype)
             and (args.status is None or p.valid == (args.status == "valid"))]
    if args.json:
        out.print_json([_entry_json(p) for p in shown])
        return 0
    out.print_table(PROFILE_COLUMNS, _profile_rows(shown))
    print(f"{len(shown)} profiles")
    return 0


def _configure_profiles(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=_op, help="only this op (repeatable; default: all)")
    parser.add_argument("--workload", action="append", type=_workload, help="only this workload: vmap, grad, "
                        "vmap(grad), jacrev, jacfwd, hessian (repeatable; default: all)")
    parser.add_argument("--dtype", default=None, type=_any_dtype, help="only this dtype, e.g. float32")
    parser.add_argument("--status", default=None, choices=("valid", "invalid"),
                        help="only timed (valid) or only invalid profiles")
    _add_json(parser, "the stored profiles")
    parser.set_defaults(run=_profiles)


def _profile(args: argparse.Namespace) -> int:
    import torch

    from registry.profiling.timing import profile
    from registry.store import evidence
    from registry.store.benchlock import timed_run

    def waiting(holder: str, path: object) -> None:
        out.note("profile", f"waiting for the benchmark of pid {holder} to finish ({path})")

    store = _open_store()
    dtypes = [getattr(torch, name) for name in (args.dtype or ["float32"])]  # names from RUN_DTYPES
    refused: list[str] = []
    try:
        start = time.perf_counter()
        with out.progress("profile", "timings") as progress:
            entries = timed_run(store, "profile", lambda: profile(
                ops=args.op or None, workloads=args.stack or None, batch_sizes=args.batch or (1, 32, 256),
                dtypes=dtypes, device=args.device, min_run_time=args.min_run_time, progress=progress,
                refused=refused), on_wait=waiting)
        elapsed = time.perf_counter() - start
        store.write_profiles(entries)
    except (ValueError, KeyError) as error:
        raise UsageError(str(error)) from None
    finally:
        store.close()
    evidence.use_profile_loader(None)
    if args.json:
        out.print_json({"seconds": round(elapsed, 1), "profiles": [_entry_json(e) for e in entries],
                        "refused": refused})
        return 0
    out.print_table(PROFILE_COLUMNS, _profile_rows(entries))
    valid = [e for e in entries if e.valid]
    print(f"{len(entries)} profiles ({len(valid)} timed) in {elapsed:.0f} s, written to {store.url}")
    for line in refused:
        print(f"refused (not stored): {line}")
    return 0


def _configure_profile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=_op, help="an op to profile (repeatable; default: all)")
    parser.add_argument("--stack", action="append", type=_workload,
                        help="a workload: vmap, grad, vmap(grad) (or vmap,grad), jacrev, jacfwd, hessian "
                             "(repeatable; default: all)")
    parser.add_argument("--batch", action="append", type=_positive,
                        help="a batch size (repeatable; default: 1, 32 and 256)")
    parser.add_argument("--dtype", action="append", type=_dtype,
                        help=f"{', '.join(RUN_DTYPES)} (repeatable; default: float32)")
    parser.add_argument("--device", default="cpu", type=_device, help="a device this host has: cpu, cuda, cuda:1")
    parser.add_argument("--min-run-time", type=_seconds, default=0.1,
                        help="seconds each context is timed for, over its rounds (default 0.1)")
    _add_json(parser, "the profiles and the contexts refused as too noisy")
    parser.set_defaults(run=_profile)


# --- report ----------------------------------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    from registry.reports.plots import remeasured, render_speedups_png, speedup_bars

    store = _open_store()
    try:
        matrix, profiles = _fresh(store)
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
    out.print_table(("op", "workload", "dtype", "batch", "composite", "speedup", "low", "high", "note"),
                    [(b.op, b.workload, b.dtype, b.batch_size, b.composite,
                      f"{b.speedup:.2f}x" if b.speedup is not None else None,
                      f"{b.low:.2f}" if b.low is not None else None, f"{b.high:.2f}" if b.high is not None else None,
                      f"invalid: {b.invalid}" if b.invalid is not None
                      else "no valid native timing" if b.speedup is None
                      else "re-measured" if b.remeasured else "")
                     for b in bars])
    if path is not None:
        print(f"wrote {path} ({len(bars)} bars; error bars: each median +- IQR/2)")
    print(f"re-measured (the first run was disturbed): {len(again) or 'none'}")
    for line in again:
        print(f"  {line}")
    return 0


def _configure_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--png", type=_png, default=None, help="also draw the bars into this PNG (the folder must "
                        "exist)")
    _add_json(parser, "the bars (speedup over native with its spread, or why invalid)")
    parser.set_defaults(run=_report)


# --- survey, survey-results ------------------------------------------------------------------------------------------


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


def _configure_survey(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", help="an op_db entry, 'add' or 'scatter_reduce.prod' (repeatable; "
                        "default: all)")
    parser.add_argument("--stack", action="append", help="vmap, grad, vmap(grad), jacrev, jacfwd, vmap(jvp) "
                        "(repeatable; default: all)")
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"),
                        help="float32 or float64 (repeatable; default: both)")
    parser.add_argument("--limit-samples", type=int, default=2, help="OpInfo samples per entry and dtype (default 2)")
    parser.add_argument("--timeout", type=_seconds, default=20.0, help="seconds per case (default 20)")
    parser.add_argument("--workers", type=int, default=None, help="forked worker processes (default: 2, 0: none)")
    _add_json(parser, "the rows and the summary")
    parser.set_defaults(run=_survey)


SURVEY_COLUMNS = ("op", "stack", "batching", "dtype", "native_status", "use_status", "max_abs_error", "samples")


def _survey_results(args: argparse.Namespace) -> int:
    import torch

    from registry.harness import survey
    from registry.store.survey import survey_rows

    try:
        stacks = {survey.normalize_stack(s) for s in args.stack} if args.stack else None
    except survey.SurveyError as error:
        raise UsageError(str(error)) from None
    store = _open_store()
    try:
        rows = survey_rows(store, torch_version=torch.__version__)
    finally:
        store.close()
    rows = [r for r in rows if (not args.op or r["op"] in args.op) and (stacks is None or r["stack"] in stacks)
            and (not args.misbehaving or r["native_status"] in survey.MISBEHAVING)]
    if args.json:
        out.print_json(rows)
        return 0
    out.print_table((*SURVEY_COLUMNS, "detail"),
                    [(*(r[c] for c in SURVEY_COLUMNS), r["native_detail"] or r["use_detail"]) for r in rows])
    print(f"{len(rows)} survey rows for torch {torch.__version__}")
    return 0


def _configure_survey_results(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", help="only this op_db entry, e.g. add (repeatable; default: all)")
    parser.add_argument("--stack", action="append", help="only this stack: vmap, grad, vmap(grad), jacrev, jacfwd, "
                        "vmap(jvp) (repeatable; default: all)")
    parser.add_argument("--misbehaving", action="store_true",
                        help="only rows where native is slow, errs or mismatches")
    _add_json(parser, "the stored survey rows")
    parser.set_defaults(run=_survey_results)


# --- jobs ------------------------------------------------------------------------------------------------------------


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + "Z"


def _jobs(args: argparse.Namespace) -> int:
    store = _open_store()
    try:
        if args.id is not None:
            job = store.job(args.id)
            if job is None:
                raise UsageError(f"no job {shorten(args.id)!r} in the store at {store.url}; `multicomposite jobs` "
                                 "lists them")
            jobs = [job]
        else:
            jobs = store.jobs(states=args.state)
    finally:
        store.close()
    if args.json:
        listed = [vars(job) for job in jobs]
        out.print_json(listed[0] if args.id is not None else listed)
        return 0
    out.print_table(("id", "kind", "state", "progress", "created", "finished", "error"),
                    [(job.id, job.kind, job.state, f"{job.done}/{job.total}", _when(job.created_at),
                      _when(job.finished_at), job.error) for job in jobs])
    return 0


def _configure_jobs(parser: argparse.ArgumentParser) -> None:
    from registry.store.db import JOB_STATES

    parser.add_argument("id", nargs="?", default=None, help="one job's id (default: list every job)")
    parser.add_argument("--state", action="append", choices=JOB_STATES,
                        help=f"only jobs in this state: {', '.join(JOB_STATES)} (repeatable)")
    _add_json(parser, "the jobs (or the one job) with their parameters and results")
    parser.set_defaults(run=_jobs)


def _configure_db(parser: argparse.ArgumentParser) -> None:
    from service.db_commands import configure_db

    configure_db(parser)  # db upgrade, db current (service/db_commands.py)


def _configure_worker(parser: argparse.ArgumentParser) -> None:
    from service.worker import configure_worker

    configure_worker(parser)  # `multicomposite worker`: service/worker.py


# --- the table of subcommands ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]  # adds the arguments; set_defaults(run=...)
    reads: bool = False  # only reads: takes --json


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("serve", "serve the HTTP API and the dashboard", _configure_serve),
    Subcommand("ops", "list the covered ops and their composites", _configure_ops, reads=True),
    Subcommand("select", "show the decision for an op under a stack, and every alternative's verdict",
               _configure_select, reads=True),
    Subcommand("verify", "verify every composite under every stack; fill the store", _configure_verify),
    Subcommand("matrix", "show the stored verified matrix, native's failures (--failing), or a heatmap (--png)",
               _configure_matrix, reads=True),
    Subcommand("profile", "time every composite side by side with native; fill the store", _configure_profile),
    Subcommand("profiles", "show the stored profiles", _configure_profiles, reads=True),
    Subcommand("report", "show the speedup over native per op and workload; draw it with --png", _configure_report,
               reads=True),
    Subcommand("survey", "run OpInfo's op_db under the stacks, natively and inside use(); fill the store",
               _configure_survey),
    Subcommand("survey-results", "show the stored survey rows", _configure_survey_results, reads=True),
    Subcommand("jobs", "show the verify and profile jobs the service has run or queued", _configure_jobs,
               reads=True),
    Subcommand("db", "the store's schema: show its revision (db current), or upgrade it (db upgrade)",
               _configure_db),
    Subcommand("worker", "run verify and profile jobs for the device kinds of this machine (needs a PostgreSQL "
               "store)", _configure_worker),
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multicomposite", description=__doc__.splitlines()[0],
                     epilog="exit codes: 0 done, 1 a failure was found (verify), 2 bad input")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND",
                                     help="one of the commands below; COMMAND --help for its options")
    from service.extras import configure_or_defer

    for command in SUBCOMMANDS:
        configure_or_defer(command.configure, commands.add_parser(command.name, help=command.help,
                                                                  description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as error:  # a library of an extra that is not installed: say which extra
        from service.extras import report_missing_extra

        return report_missing_extra(error, argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParserExit as finished:
        return finished.code
    try:
        return args.run(args)
    except UsageError as error:
        print(f"multicomposite {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
