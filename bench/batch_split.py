"""What batch splitting costs, measured side by side in one process (``python -m bench.batch_split``).

``vmap(grad(f))`` of a 128 -> 128 tanh layer with a Python branch on a mask (``if m.all():``), batch 64:

- every sample agrees, inside ``use()`` (the function runs once: nothing is re-run);
- the batched form that needs no branch (``torch.where``), natively;
- 2 groups of 32 (``if m.all():``) and 8 groups of 8 (``.item()`` of a count of zeros): the first run up to the
  disagreement, then one vmap per group;
- the per-sample loop of ``grad`` over the same samples (2 groups' masks).

Each is timed in alternating rounds, on one thread and its CPU time; the minimum and the median over rounds are
reported (noise only ever adds time).
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
from torch import func
from torch.utils.benchmark import Timer

import registry

BATCH, WIDTH = 64, 128


def _ms(stmt: Callable[[], object], min_run_time: float) -> float:
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=1, timer=time.thread_time)
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def cases() -> dict[str, tuple[Callable[[], object], bool]]:
    """name -> (the call, whether it runs inside use())."""
    torch.manual_seed(0)
    weight = torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5
    x = torch.randn(BATCH, WIDTH)

    def branching(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(v @ weight)
        if m.all():
            return (h ** 2).sum()
        return ((h * m) ** 2).sum()

    def counting(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(v @ weight)
        return ((h * m) ** 2).sum() * (int((m == 0).sum().item()) + 1)  # one group per count of zeros

    def batched(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(v @ weight)
        return (torch.where(m.all(), h, h * m) ** 2).sum()

    def masks(groups: int) -> torch.Tensor:
        m = torch.ones(BATCH, WIDTH)
        for sample in range(BATCH):
            m[sample, : sample % groups] = 0  # groups distinct masks, BATCH / groups samples each
        return m

    agree, two, eight = masks(1), masks(2), masks(8)
    step = func.vmap(func.grad(branching))
    return {
        "agreeing, inside use()": (lambda: step(x, agree), True),
        "torch.where form, native": (lambda: func.vmap(func.grad(batched))(x, two), False),
        "2 groups, inside use()": (lambda: step(x, two), True),
        "8 groups (.item()), inside use()": (lambda: func.vmap(func.grad(counting))(x, eight), True),
        "per-sample loop (2 groups' masks)": (lambda: torch.stack([func.grad(branching)(x[i], two[i])
                                                                   for i in range(BATCH)]), True),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    measured = cases()
    times: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, (call, inside) in measured.items():
            if inside:
                with registry.use():
                    times[name].append(_ms(call, args.min_run_time))
            else:
                times[name].append(_ms(call, args.min_run_time))
    for name, values in times.items():
        kept = sorted(values[1:])
        print(f"{name:36s} min {kept[0]:7.2f} ms   median {kept[len(kept) // 2]:7.2f} ms")


if __name__ == "__main__":
    main()
