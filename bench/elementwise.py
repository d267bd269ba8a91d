"""Elementwise and statistics ops, native vs inside ``use()`` (policy auto), batch 64 x 1,000 elements: under vmap
(where native loops over the batch) and with no transform and under grad (where ``auto`` keeps native; the cost
inside ``use()`` there is the router's).

    .venv/bin/python -m bench.elementwise
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import func
from torch.utils.benchmark import Timer

import registry

BATCH, SIZE = 64, 1000


def _cases() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(BATCH, SIZE, generator=g) * 1.8 - 0.9
    tests = torch.randn(50, generator=g)
    return {
        "special.chebyshev_polynomial_t": (lambda v: torch.special.chebyshev_polynomial_t(v, 5), x),
        "special.log_ndtr": (lambda v: torch.special.log_ndtr(v), x),
        "isin": (lambda v: torch.isin(v, tests), x),
        "renorm": (lambda v: torch.renorm(v.reshape(10, 100), 2, 0, 1.0), x),
        "quantile": (lambda v: torch.quantile(v, 0.3), x),
        "histc": (lambda v: torch.histc(v, 20), x),
    }


def _median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median * 1e3


def measure(min_run_time: float = 0.2) -> list[tuple[str, str, float, float]]:
    """(op, stack, native ms, inside use() ms)."""
    rows = []
    for op, (f, x) in _cases().items():
        differentiable = op not in ("special.chebyshev_polynomial_t", "isin", "histc")
        stacks: dict[str, Callable[[], object]] = {"none": lambda f=f, x=x: f(x[0]),
                                                   "vmap": lambda f=f, x=x: func.vmap(f)(x)}
        if differentiable:
            stacks["grad"] = lambda f=f, x=x: func.grad(lambda v: f(v).sum())(x[0])
        for stack, call in stacks.items():
            native = _median_ms(call, min_run_time)
            with registry.use():
                routed = _median_ms(call, min_run_time)
            rows.append((op, stack, native, routed))
    return rows


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'op':32} {'stack':6} {'native ms':>10} {'use() ms':>10} {'speedup':>8}")
    for op, stack, native, routed in measure():
        print(f"{op:32} {stack:6} {native:10.3f} {routed:10.3f} {native / routed:8.2f}")


if __name__ == "__main__":
    main()
