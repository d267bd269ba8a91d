"""``multicomposite profile``: time every composite side by side with native; the timings go to the store. Batch
sizes are bounded as POST /profiles bounds them (``service.limits``)."""

from __future__ import annotations

import argparse
import time

from service import cli_output as out
from service.cli import arguments
from service.cli.profiles import print_profiles
from service.cli.store import entry_json, open_store
from service.cli_output import UsageError
from service.limits import MAX_BATCH


def run(args: argparse.Namespace) -> int:
    with out.progress("profile", "timings") as progress:
        import torch

        from registry.profiling.stored_profile import profile_into

        def waiting(holder: str, path: object) -> None:
            out.note("profile", f"waiting for the benchmark of pid {holder} to finish ({path})")

        store = open_store()
        dtypes = [getattr(torch, name) for name in (args.dtype or ["float32"])]  # names from RUN_DTYPES
        refused: list[str] = []
        try:
            start = time.perf_counter()
            entries = profile_into(store, ops=args.op or None, workloads=args.stack or None,
                                   batch_sizes=args.batch or (1, 32, 256), dtypes=dtypes, device=args.device,
                                   min_run_time=args.min_run_time, progress=progress, refused=refused,
                                   on_wait=waiting)
            elapsed = time.perf_counter() - start
        except KeyboardInterrupt:
            raise KeyboardInterrupt("nothing of this run was stored") from None
        except (ValueError, KeyError) as error:
            raise UsageError(str(error)) from None
        finally:
            store.close()
    if args.json:
        out.print_json({"seconds": round(elapsed, 1), "profiles": [entry_json(e) for e in entries],
                        "refused": refused})
        return 0
    print_profiles(entries)
    valid = [e for e in entries if e.valid]
    print(f"{len(entries)} profiles ({len(valid)} timed) in {elapsed:.0f} s, written to {store.url}")
    for line in refused:
        print(f"refused (not stored): {line}")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=arguments.op, help="an op to profile (repeatable; default: all)")
    parser.add_argument("--stack", action="append", type=arguments.workload,
                        help="a workload: vmap, grad, vmap(grad) (or vmap,grad), jacrev, jacfwd, hessian "
                             "(repeatable; default: all)")
    parser.add_argument("--batch", action="append", type=arguments.batch_size,
                        help=f"a batch size, 1..{MAX_BATCH} (repeatable; default: 1, 32 and 256)")
    parser.add_argument("--dtype", action="append", type=arguments.run_dtype,
                        help=f"{', '.join(arguments.RUN_DTYPES)} (repeatable; default: float32)")
    parser.add_argument("--device", default="cpu", type=arguments.device,
                        help="a device this host has: cpu, cuda, cuda:1")
    parser.add_argument("--min-run-time", type=arguments.positive_seconds, default=0.1,
                        help="seconds each context is timed for, over its rounds (default 0.1)")
    arguments.add_json(parser, "the profiles and the contexts refused as too noisy")
    parser.set_defaults(run=run)
