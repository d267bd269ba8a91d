"""What routing at the dispatcher costs, measured side by side in one process (``python -m bench --routing``).

(r1) ``with use(): pass`` — construction, enter and exit (target <= 2 us)
(r2) a whole ``vmap(grad(f))`` call whose covered op runs PyTorch's own kernel: index_add, batch 8, 6 x 64, inside
     vs outside ``use()`` (target >= 0.97x native)
(r3) a routed op over its composite called directly: masked_scatter under vmap, batch 8, 5 x 4, inside ``use()``
     (functional chosen) vs vmap of the functional composite outside (target <= 3 us added)
(r4) eager, no transform: a covered op (index_add) and an uncovered one (add) inside vs outside ``use()``
     (targets <= 1 us and 0 added)

Each pair is timed in alternating rounds (``torch.utils.benchmark.Timer.blocked_autorange``); the minimum over rounds
is reported, since on a shared machine noise only ever adds time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import func
from torch.utils.benchmark import Timer

import registry


def _us(stmt: Callable[[], object], min_run_time: float) -> float:
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def _pair(outside: Callable[[], object], inside: Callable[[], object], rounds: int, min_run_time: float,
          inside_use: bool = True, pins: dict[str, str] | None = None) -> tuple[float, float]:
    """(outside, inside) microseconds, min over alternating rounds; ``inside`` runs within ``use(pins=pins)``."""
    outside_times, inside_times = [], []
    for _ in range(rounds):
        outside_times.append(_us(outside, min_run_time))
        with registry.use(pins=pins) if inside_use else contextlib.nullcontext():
            inside_times.append(_us(inside, min_run_time))
    return min(outside_times), min(inside_times)


def bench_enter_exit(rounds: int, min_run_time: float) -> dict[str, float]:
    def empty() -> None:
        with contextlib.nullcontext():
            pass

    def enter_exit() -> None:
        with registry.use():
            pass

    baseline, routed = _pair(empty, enter_exit, rounds, min_run_time, inside_use=False)
    return {"enter_exit_us": routed, "nullcontext_us": baseline}


def bench_vmap_grad_native(rounds: int, min_run_time: float) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 64, generator=generator)
    index = torch.tensor([0, 2, 5, 1])
    source = torch.randn(4, 64, generator=generator)

    def loss(row: torch.Tensor) -> torch.Tensor:
        return row.index_add(0, index, source * row[:4]).pow(2).sum()

    per_sample_grads = func.vmap(func.grad(loss))
    with registry.use():
        torch.testing.assert_close(per_sample_grads(x), func.vmap(func.grad(loss))(x))
    decision = registry.select("index_add", stack="vmap,grad", batched=["self", "source"], dtype="float32")
    native, routed = _pair(lambda: per_sample_grads(x), lambda: per_sample_grads(x), rounds, min_run_time)
    return {"native_us": native, "routed_us": routed, "ratio": native / routed, "composite": decision.composite}


def bench_routed_over_composite(rounds: int, min_run_time: float) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    x, source = torch.randn(8, 5, 4, generator=generator), torch.randn(8, 5, 4, generator=generator)
    mask = torch.rand(8, 5, 4, generator=generator) > 0.5
    functional = registry.composites("masked_scatter")["functional"].fn
    direct = func.vmap(functional)
    routed = func.vmap(lambda s, m, v: s.masked_scatter(m, v))
    pins = {"masked_scatter": "functional"}  # the same composite both ways, whatever the profiles would pick
    with registry.use(pins=pins):
        torch.testing.assert_close(routed(x, mask, source), direct(x, mask, source))
    direct_us, routed_us = _pair(lambda: direct(x, mask, source), lambda: routed(x, mask, source), rounds,
                                 min_run_time, pins=pins)
    return {"composite_us": direct_us, "routed_us": routed_us, "added_us": routed_us - direct_us}


def bench_eager(rounds: int, min_run_time: float) -> dict[str, float]:
    a, b = torch.randn(8), torch.randn(8)
    x, index, source = torch.randn(8, 4), torch.tensor([0, 3]), torch.randn(2, 4)
    add_out, add_in = _pair(lambda: torch.add(a, b), lambda: torch.add(a, b), rounds, min_run_time)
    covered_out, covered_in = _pair(lambda: x.index_add(0, index, source), lambda: x.index_add(0, index, source),
                                    rounds, min_run_time)
    return {"uncovered_native_us": add_out, "uncovered_added_us": add_in - add_out,
            "covered_native_us": covered_out, "covered_added_us": covered_in - covered_out}


def print_routing(rounds: int, min_run_time: float) -> dict[str, dict[str, float]]:
    results = {
        "enter_exit": bench_enter_exit(rounds, min_run_time),
        "vmap_grad_native": bench_vmap_grad_native(rounds, min_run_time),
        "routed_over_composite": bench_routed_over_composite(rounds, min_run_time),
        "eager": bench_eager(rounds, min_run_time),
    }
    r = results["enter_exit"]
    print(f"(r1) with use(): pass  {r['enter_exit_us']:.2f} us (an empty with-statement {r['nullcontext_us']:.2f} us;"
          f" target <= 2 us)")
    r = results["vmap_grad_native"]
    print(f"(r2) vmap(grad(f)), index_add runs {r['composite']}, batch 8, 6 x 64: native {r['native_us']:.1f} us, "
          f"inside use() {r['routed_us']:.1f} us -> {r['ratio']:.3f}x native (target >= 0.97x)")
    r = results["routed_over_composite"]
    print(f"(r3) masked_scatter under vmap, batch 8, 5 x 4: functional composite {r['composite_us']:.1f} us, "
          f"routed inside use() {r['routed_us']:.1f} us -> {r['added_us']:+.2f} us (target <= 3 us)")
    r = results["eager"]
    print(f"(r4) eager inside use(): covered index_add {r['covered_added_us']:+.2f} us (native "
          f"{r['covered_native_us']:.2f} us; target <= 1 us), uncovered add {r['uncovered_added_us']:+.2f} us "
          f"(native {r['uncovered_native_us']:.2f} us; target 0)")
    return results


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print_routing(rounds=7, min_run_time=0.2)
