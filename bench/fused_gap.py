"""Where the fused primitives' time goes under vmap and vmap(grad), 256 x 1,000 float32, on each routing backend
(``python -m bench.fused_gap``).

Per op and stack, in interleaved rounds (``registry.profiling.noise.interleaved``):
    native  PyTorch alone (outside ``use()``)
    floor   the same loss with the op left out (``pow(2).sum()`` and the transform's own machinery)
    direct  the primitive composite called directly inside the loss, inside the same ``use()`` as routed (so the
            loss's other ops are routed alike)
    routed  the op inside ``use(pins={op: "primitive"})`` on the backend
    cpp     the op inside ``use(pins={op: "cpp_op"})`` on the backend: the primitive as a C++ op (where it is built)
So ``routed - direct`` is what routing the op costs, ``direct - floor`` what the primitive itself costs, and
``needs`` (``native / target``) how fast the whole call would have to be.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import func

import registry
from registry.core import routing
from registry.profiling import noise

BATCH, SIZE = 256, 1000
TARGETS = {"masked_scatter": (5.0, 5.0), "masked_fill": (5.0, 3.0), "index_fill": (5.0, 3.0)}  # (vmap, vmap(grad))


def _cpp_op_valid(op: str) -> bool:
    from registry.core import kernels

    return "cpp_op" in registry.composites(op) and kernels.fused_ops_available()


def _primitive(op: str) -> Callable[..., torch.Tensor]:
    return next(c.fn for c in registry.composites(op).values() if c.kind == "primitive")


def _cases() -> dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    """op -> (loss through the op, loss through the primitive directly, arguments): bench/kinds.py's cases."""
    g = torch.Generator().manual_seed(0)
    x, source = torch.randn(BATCH, SIZE, generator=g), torch.randn(BATCH, SIZE, generator=g)
    mask, value = torch.rand(BATCH, SIZE, generator=g) > 0.5, torch.randn(BATCH, generator=g)
    index = torch.randint(0, SIZE, (100,), generator=g)
    scatter, fill, index_fill = (_primitive(op) for op in ("masked_scatter", "masked_fill", "index_fill"))
    return {
        "masked_scatter": (lambda r, m, s: r.masked_scatter(m, s).pow(2).sum(),
                           lambda r, m, s: scatter(r, m, s).pow(2).sum(), (x, mask, source)),
        "masked_fill": (lambda r, m, v: r.masked_fill(m, v).pow(2).sum(),
                        lambda r, m, v: fill(r, m, v).pow(2).sum(), (x, mask, value)),
        "index_fill": (lambda r, v: r.index_fill(0, index, v).pow(2).sum(),
                       lambda r, v: index_fill(r, 0, index, v).pow(2).sum(), (x, value)),
    }


def _quiet(f: Callable[..., Any], args: tuple[Any, ...], **use: Any) -> Callable[[], Any]:
    def run() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # native's per-sample fallback warns
            if use:
                with registry.use(**use):
                    return f(*args)
            return f(*args)

    return run


def measure(rounds: int, min_run_time: float, backend: str) -> list[dict[str, Any]]:
    routing.set_routing_backend(backend)
    rows = []
    for op, (loss, direct_loss, args) in _cases().items():
        for stack, transform in (("vmap", func.vmap), ("vmap(grad)", lambda f: func.vmap(func.grad(f)))):
            runners = {
                "native": _quiet(transform(loss), args),
                "floor": _quiet(transform(lambda r, *rest: r.pow(2).sum()), args),
                "direct": _quiet(transform(direct_loss), args, pins={op: "primitive"}),
                "routed": _quiet(transform(loss), args, pins={op: "primitive"}),
            }
            if _cpp_op_valid(op):
                runners["cpp"] = _quiet(transform(loss), args, pins={op: "cpp_op"})
            for name in ("routed", "cpp"):
                if name in runners:
                    torch.testing.assert_close(runners[name](), runners["native"]())
            timed = noise.interleaved(runners, rounds=rounds, min_run_time=min_run_time, clock=time.thread_time)
            us = {name: t.median_us for name, t in timed.items()}
            target = TARGETS[op][stack == "vmap(grad)"]
            rows.append({"backend": backend, "op": op, "stack": stack, **us, "speedup": us["native"] / us["routed"],
                         "cpp_speedup": us["native"] / us["cpp"] if "cpp" in us else None,
                         "target": target, "target_us": us["native"] / target})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fused_gap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per runner over all rounds")
    parser.add_argument("--backend", choices=("cpp", "python"), action="append",
                        help="only this backend (repeatable; default: both)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # timed in thread CPU time: one thread, so all of the work is counted
    print(f"torch {torch.__version__}, 1 thread, thread CPU time, median of {args.rounds} interleaved rounds, us")
    print(f"{'backend':7s} {'op':15s} {'stack':11s} {'native':>7s} {'floor':>7s} {'direct':>7s} {'routed':>7s} "
          f"{'routing':>8s} {'speedup':>8s} {'target':>7s} {'needs':>7s} {'cpp':>7s} {'cpp x':>7s}")
    active = routing.routing_backend()
    try:
        for backend in args.backend or ("cpp", "python"):
            for r in measure(args.rounds, args.min_run_time, backend):
                print(f"{r['backend']:7s} {r['op']:15s} {r['stack']:11s} {r['native']:7.0f} {r['floor']:7.0f} "
                      f"{r['direct']:7.0f} {r['routed']:7.0f} {r['routed'] - r['direct']:+8.0f} "
                      f"{r['speedup']:7.2f}x {r['target']:6.0f}x {r['target_us']:7.0f} "
                      + (f"{r['cpp']:7.0f} {r['cpp_speedup']:6.2f}x" if r["cpp_speedup"] is not None else ""))
    finally:
        routing.set_routing_backend(active)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
