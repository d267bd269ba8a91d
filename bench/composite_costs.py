"""``python -m bench.composite_costs [--rounds 9]``: what a routed call costs inside ``use()`` against native, for the
composites routed on many models: ``to`` and ``contiguous`` under vmap, ``embedding`` with batched indices under
vmap(grad), and the folded SDPA call (pinned) at small batches, forward (vmap) and with its backward (vmap(grad)).

One intra-op thread, the calling thread's CPU time, interleaved rounds (native: inside ``use(policy="native")``, so
that use()'s own entry is paid alike; then ``use()``; the order swapped every round); each row: the median per-call
time of each and the median of the per-round ratios native / use().
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import func

import registry
from bench.small_batches import per_call_us

SDPA = torch.nn.functional.scaled_dot_product_attention


def cases() -> dict[str, tuple[Callable[[], Any], dict[str, Any]]]:
    """name -> (the transformed call, use()'s arguments)."""
    g = torch.Generator().manual_seed(0)
    found: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {}
    x = torch.randn(64, 32, 16, generator=g)
    to = func.vmap(lambda t: t.to(torch.float64))
    found["to(float64) under vmap, 64 x (32, 16)"] = (lambda: to(x), {})
    contiguous = func.vmap(lambda t: t.contiguous())
    found["contiguous (already) under vmap, 64 x (32, 16)"] = (lambda: contiguous(x), {})
    strided = func.vmap(lambda t: t.t().contiguous())
    found["contiguous of a transpose under vmap, 64 x (16, 32)"] = (lambda: strided(x), {})
    weight = torch.randn(5000, 64, generator=g)
    ids = torch.randint(0, 5000, (64, 16), generator=g)
    lookup = func.vmap(lambda i: torch.nn.functional.embedding(i, weight))
    found["embedding lookup under vmap, 64 x 16 ids of 5,000 x 64"] = (lambda: lookup(ids), {})
    for batch in (4, 16, 64):
        q = torch.randn(batch, 1, 2, 16, 16, generator=g)
        forward = func.vmap(lambda a: SDPA(a, a, a))
        backward = func.vmap(func.grad(lambda a: SDPA(a, a, a).square().sum()))
        pins = {"pins": {"scaled_dot_product_attention": "primitive"}}
        found[f"sdpa folded (pinned) vmap, {batch} x (1, 2, 16, 16)"] = (lambda f=forward, q=q: f(q), pins)
        found[f"sdpa folded (pinned) vmap(grad), {batch} x (1, 2, 16, 16)"] = (lambda f=backward, q=q: f(q), pins)
        found[f"sdpa auto vmap(grad), {batch} x (1, 2, 16, 16)"] = (lambda f=backward, q=q: f(q), {})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.composite_costs", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--min-run-time", type=float, default=0.05, help="thread CPU seconds per timing")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'case':58} {'native us':>10} {'use us':>9} {'native/use':>10}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (call, within) in cases().items():
            if args.only not in name:
                continue
            def inside(call: Callable[[], Any] = call, within: dict[str, Any] = within) -> Any:
                with registry.use(**within):
                    return call()

            def native(call: Callable[[], Any] = call) -> Any:
                with registry.use(policy="native"):  # use()'s own entry paid alike: the difference is the call's
                    return call()

            native_us, use_us = [], []
            native()
            inside()
            for index in range(args.rounds):
                order = ((native_us, native), (use_us, inside))
                for times, stmt in order if index % 2 == 0 else order[::-1]:
                    times.append(per_call_us(stmt, args.min_run_time))
            ratio = statistics.median(n / u for n, u in zip(native_us, use_us, strict=True))
            print(f"{name:58} {statistics.median(native_us):>10.1f} {statistics.median(use_us):>9.1f} "
                  f"{ratio:>9.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
