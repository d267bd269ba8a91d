"""Every kind of composite side by side under vmap and vmap(grad), batch 256 x 1,000 elements: the measurements
behind the rules' order of preference (``registry/rules.py``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import func
from torch.utils.benchmark import Timer

import registry

KINDS = ("native", "functional", "primitive")


def loss_cases() -> dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(0)
    batch, size = 256, 1000
    x, source = torch.randn(batch, size, generator=g), torch.randn(batch, size, generator=g)
    mask, value = torch.rand(batch, size, generator=g) > 0.5, torch.randn(batch, generator=g)
    index = torch.randint(0, size, (100,), generator=g)
    unique = index.unique()
    return {
        "masked_scatter": (lambda r, m, s: r.masked_scatter(m, s).pow(2).sum(), (x, mask, source)),
        "masked_fill": (lambda r, m, v: r.masked_fill(m, v).pow(2).sum(), (x, mask, value)),
        "index_fill": (lambda r, v: r.index_fill(0, index, v).pow(2).sum(), (x, value)),
        "index_add": (lambda r, s: r.index_add(0, index, s[:100]).pow(2).sum(), (x, source)),
        "index_copy": (lambda r, s: r.index_copy(0, unique, s[: unique.numel()]).pow(2).sum(), (x, source)),
    }


def compare_kinds(min_run_time: float = 0.3) -> list[tuple[str, str, dict[str, float]]]:
    """(op, stack, {kind: median ms}); NaN where a kind raised."""
    rows = []
    for op, (loss, args) in loss_cases().items():
        for stack, f in (("vmap", func.vmap(loss)), ("vmap(grad)", func.vmap(func.grad(loss)))):
            times = {}
            for kind in KINDS:
                routing = registry.use(policy="native") if kind == "native" else registry.use(pins={op: kind})
                with routing, contextlib.suppress(RuntimeError):
                    times[kind] = math.nan
                    f(*args)
                    timer = Timer("f(*args)", globals={"f": f, "args": args})
                    times[kind] = timer.blocked_autorange(min_run_time=min_run_time).median * 1e3
            rows.append((op, stack, times))
    return rows


def print_kinds(min_run_time: float = 0.3) -> None:
    print("kinds side by side, 256 x 1000, median ms (native = PyTorch alone, vmap fallback included):")
    for op, stack, times in compare_kinds(min_run_time):
        cells = "  ".join(f"{kind} {times[kind]:7.2f}" for kind in KINDS)
        print(f"  {op:15s} {stack:11s} {cells}")


if __name__ == "__main__":
    print_kinds()
