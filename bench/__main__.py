"""``python -m bench``: selected composites vs native PyTorch, and what routing costs.

(a) the fused primitives and auto vs native under vmap and vmap(grad), batch 256 x 1,000 float32, beside one pass
    over the data (targets: masked_scatter >= 5x; masked_fill, index_fill >= 5x under vmap, >= 3x under
    vmap(grad); auto >= 0.97x native where native has a batching rule)
(r1)-(r4) what routing at the dispatcher costs (bench/routing.py): use() enter + exit, a vmap(grad) call whose
    covered op runs native, a routed op over its composite, eager covered and uncovered ops
(c) a small MLP training step, forward + backward + optimizer (20+ ops), inside vs outside use() (target <= 3%)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from torch import nn
from torch.utils.benchmark import Timer

import registry
from bench.api import print_api
from bench.fused import print_compare, print_pieces
from bench.kinds import print_kinds
from bench.routing import print_routing
from bench.sweep import print_sweep


def _median_us(stmt, min_run_time: float) -> float:
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def _side_by_side(native, routed, rounds: int, min_run_time: float, statistic=statistics.median):
    """Microseconds of each (``statistic`` over rounds of medians), alternating rounds so drift hits both alike.

    For the per-call overheads ``min`` is used: on a shared 2-core machine noise only ever adds time, and a
    microsecond difference drowns in it otherwise.
    """
    native_times, routed_times = [], []
    for _ in range(rounds):
        native_times.append(_median_us(native, min_run_time))
        with registry.use():
            routed_times.append(_median_us(routed, min_run_time))
    return statistic(native_times), statistic(routed_times)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                    nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        # One covered op on the hot path: padded rows are zeroed with masked_fill.
        return self.layers(x.masked_fill(padding, 0.0))


def bench_mlp(rounds: int, min_run_time: float) -> dict[str, float]:
    torch.manual_seed(0)
    model = _MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, target = torch.randn(32, 64), torch.randint(0, 10, (32,))
    padding = torch.zeros(32, 1, dtype=torch.bool)
    padding[-4:] = True

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x, padding), target)
        loss.backward()
        optimizer.step()

    outside, inside = _side_by_side(step, step, rounds, min_run_time, min)
    return {"outside_us": outside, "inside_us": inside, "slowdown": inside / outside - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="alternating native/routed rounds")
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per blocked_autorange")
    parser.add_argument("--kinds", action="store_true", help="also time every kind of composite side by side")
    parser.add_argument("--pieces", action="store_true", help="also time each piece of the fused bodies")
    parser.add_argument("--compile", action="store_true",
                        help="with --pieces: also the Inductor-compiled select (minutes of compilation)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="(a): one thread, timed in thread CPU time (a shared machine: time spent descheduled "
                             "does not count)")
    parser.add_argument("--only-fused", action="store_true", help="stop after (a)")
    parser.add_argument("--sweep", action="store_true", help="also run the profiling sweep and auto vs native")
    parser.add_argument("--api", action="store_true", help="also load-test GET /select against hello-world")
    args = parser.parse_args(argv)
    torch.set_num_threads(1 if args.cpu_time else torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")

    print_compare(args.rounds, args.min_run_time, cpu_time=args.cpu_time)
    if args.pieces:
        print_pieces(args.rounds, args.min_run_time, cpu_time=args.cpu_time, compile=args.compile)
    if args.only_fused:
        return 0
    # (r0)-(r4): what routing at the dispatcher costs; (r5), whole model steps, is python -m bench.routing's
    print_routing(args.rounds, args.min_run_time, models_batch=None)
    result = bench_mlp(args.rounds, args.min_run_time)
    print(f"(c) MLP training step (min over rounds): outside {result['outside_us']:.0f} us, "
          f"inside use() {result['inside_us']:.0f} us "
          f"-> {result['slowdown'] * 100:+.1f}% (target <= +3%)")
    if args.kinds:
        print_kinds(args.min_run_time)
    if args.sweep:
        print_sweep(0.1)
    if args.api:
        print_api()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
