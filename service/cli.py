"""The ``multicomposite`` command line."""

from __future__ import annotations

import argparse
import json
import sys

import registry


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.main import create_app

    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info")
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
    from registry import rules
    from registry.context import Context

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

    from registry import evidence
    from registry.store import Store
    from registry.verify import verify

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
    from registry import evidence
    from registry.plots import stack_label

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

    from registry.plots import render_matrix_png
    from registry.store import Store
    from registry.verify import source_hashes

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multicomposite", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
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
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
