"""``python -m bench.checks``: what the parity checks (``composites/checks.py``) cost a composite call.

For each op, its functional composite is timed on a small sample, eagerly and under ``vmap``, as it is and with its
``check_<op>`` replaced by a function that does nothing, in alternating rounds (min over rounds of
``blocked_autorange`` medians); the check alone is timed too (on plain tensors). Small tensors, so the fixed
per-call costs dominate and the checks' share is the largest it can be.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.benchmark import Timer

import registry

# op -> (module that calls the check, check name, small valid arguments)
CASES: dict[str, tuple[str, str, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]] = {
    "index_add": ("composites.index", "check_index_add",
                  lambda: ((torch.randn(8, 4), 0, torch.tensor([0, 2, 2]), torch.randn(3, 4)), {})),
    "index_copy": ("composites.index", "check_index_copy",
                   lambda: ((torch.randn(8, 4), 0, torch.tensor([0, 2, 5]), torch.randn(3, 4)), {})),
    "index_fill": ("composites.index", "check_index_fill",
                   lambda: ((torch.randn(8, 4), 0, torch.tensor([0, 2]), torch.tensor(1.5)), {})),
    "masked_fill": ("composites.masked", "check_masked_fill",
                    lambda: ((torch.randn(8, 4), torch.rand(8, 4) > 0.5, torch.tensor(1.5)), {})),
    "masked_scatter": ("composites.masked", "check_masked_scatter",
                       lambda: ((torch.randn(8, 4), torch.rand(8, 4) > 0.5, torch.randn(32)), {})),
    "contiguous": ("composites.memory", "check_contiguous", lambda: ((torch.randn(8, 4).t(),), {})),
    "to": ("composites.memory", "check_to", lambda: ((torch.randn(8, 4),), {"dtype": torch.float64})),
}


def _median_us(stmt: Callable[[], Any], min_run_time: float) -> float:
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def _skip(*_args: Any, **_kwargs: Any) -> None:
    return None


def measure(op: str, rounds: int, min_run_time: float, batch: int = 0) -> tuple[float, float, float]:
    """(with checks, without checks, the check alone), microseconds, min over ``rounds`` alternating rounds.

    With ``batch``, the composite runs under ``torch.func.vmap`` over a batch of ``self`` (the check then reads a
    BatchedTensor's metadata)."""
    module_name, check_name, make = CASES[op]
    module = importlib.import_module(module_name)
    check = getattr(module, check_name)
    args, kwargs = make()
    functional = registry.composites(op)["functional"].fn
    if batch:
        batched_self = args[0].expand(batch, *args[0].shape).clone()
        mapped = torch.func.vmap(lambda x: functional(x, *args[1:], **kwargs))

        def composite(*_args: Any, **_kwargs: Any) -> Any:
            return mapped(batched_self)
    else:
        composite = functional
    with_checks, without, alone = [], [], []
    check_args = args + ((1,) if op == "index_add" else ())  # alpha
    if op == "contiguous":
        check_args = (args[0], torch.contiguous_format)
    elif op == "to":
        check_args = (args[0], None, None)
    try:
        for _ in range(rounds):
            setattr(module, check_name, check)
            with_checks.append(_median_us(lambda: composite(*args, **kwargs), min_run_time))
            setattr(module, check_name, _skip)
            without.append(_median_us(lambda: composite(*args, **kwargs), min_run_time))
            alone.append(_median_us(lambda: check(*check_args), min_run_time))
    finally:
        setattr(module, check_name, check)
    return min(with_checks), min(without), min(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--min-run-time", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=8, help="also time under vmap over this many samples (0: not)")
    options = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {options.rounds} rounds (min of medians)")
    for batch in (0, options.batch) if options.batch else (0,):
        where = f"vmap over {batch}" if batch else "eager"
        for op in CASES:
            checked, unchecked, alone = measure(op, options.rounds, options.min_run_time, batch)
            print(f"{op:15s} functional, {where}: with checks {checked:7.2f} us, without {unchecked:7.2f} us "
                  f"({checked - unchecked:+.2f} us, {100 * (checked - unchecked) / unchecked:+.1f}%); "
                  f"check alone {alone:.2f} us")


if __name__ == "__main__":
    main()
