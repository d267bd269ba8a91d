"""``python -m bench.models [--batch 64] [--only NAME ...] [--rounds 5]``: native vs use() vs the per-sample loop."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.benchmark import Timer

import registry
from bench.models import Setup, Workload, all_workloads
from registry.core.messages import described
from registry.harness.fallback import FALLBACK_WARNING


def _ms(stmt: Callable[[], object], min_run_time: float) -> float:
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _attempt(stmt: Callable[[], Any]) -> tuple[Any, int, str | None]:
    """(result, fallback warnings, first line of the error or None)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = stmt()
        except Exception as error:  # a workload that fails is reported, not a crash of the whole bench
            return None, 0, described(error)[:120]
    return result, sum(FALLBACK_WARNING in str(w.message) for w in caught), None


def _matches(result: Any, reference: Any, setup: Setup) -> bool:
    got, _ = tree_flatten(result)
    want, _ = tree_flatten(reference)
    if len(got) != len(want):
        return False
    return all(torch.allclose(g, w, rtol=setup.rtol, atol=setup.atol) for g, w in zip(got, want, strict=True))


def run(workload: Workload, batch: int, rounds: int, min_run_time: float) -> dict[str, Any]:
    setup = workload.build(batch)
    reference = setup.loop()
    native, native_fallbacks, native_error = _attempt(setup.step)
    with registry.use():
        routed, routed_fallbacks, routed_error = _attempt(setup.step)
    row: dict[str, Any] = {
        "workload": workload.name, "family": workload.family, "batch": batch,
        "native": native_error or ("ok" if _matches(native, reference, setup) else "mismatch"),
        "use": routed_error or ("ok" if _matches(routed, reference, setup) else "mismatch"),
        "native_fallbacks": native_fallbacks, "use_fallbacks": routed_fallbacks,
    }
    if routed_error is not None:
        return row
    native_times, routed_times, loop_times = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            if native_error is None:
                native_times.append(_ms(setup.step, min_run_time))
            with registry.use():
                routed_times.append(_ms(setup.step, min_run_time))
            loop_times.append(_ms(setup.loop, min_run_time))
    routed_ms, loop_ms = min(routed_times), min(loop_times)
    row.update(use_ms=routed_ms, loop_ms=loop_ms, loop_over_use=loop_ms / routed_ms)
    if native_times:
        native_ms = min(native_times)
        row.update(native_ms=native_ms, native_over_use=native_ms / routed_ms)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__)
    parser.add_argument("--batch", type=int, default=64, help="samples per step (default 64)")
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default 5)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing (default 0.2)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    workloads = [w for w in all_workloads() if args.only is None or w.name in args.only]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}")
    print(f"{'workload':34} {'native':>12} {'use()':>10} {'fallbacks n/u':>13} {'native ms':>10} {'use ms':>9}"
          f" {'loop ms':>9} {'native/use':>10} {'loop/use':>9}")
    for workload in workloads:
        row = run(workload, args.batch, args.rounds, args.min_run_time)
        native_ms = f"{row['native_ms']:.2f}" if "native_ms" in row else "-"
        ratio = f"{row['native_over_use']:.2f}x" if "native_over_use" in row else "-"
        print(f"{row['workload']:34} {row['native'][:12]:>12} {row['use'][:10]:>10}"
              f" {row['native_fallbacks']:>6}/{row['use_fallbacks']:<6} {native_ms:>10}"
              f" {row.get('use_ms', float('nan')):>9.2f} {row.get('loop_ms', float('nan')):>9.2f} {ratio:>10}"
              f" {row.get('loop_over_use', float('nan')):>8.2f}x")
        if row["native"] not in ("ok", "mismatch"):
            print(f"    native: {row['native']}")
        if row["use"] not in ("ok", "mismatch"):
            print(f"    use(): {row['use']}")


if __name__ == "__main__":
    main()
