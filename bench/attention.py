"""``python -m bench.attention``: scaled_dot_product_attention's composites against each other and native, per stack.

Each shape is a batch of per-sample (heads, length, head size) attentions with a key padding mask, under vmap,
vmap(grad) and jacfwd's vmap(jvp): native (outside ``use()``), and the functional and primitive composites pinned
inside ``use()``, timed in alternating rounds in one process; the ratio is the functional composite's time over the
primitive's (above 1: the fused primitive is faster), which is what ``define_op(..., preference=...)`` encodes.

``--cpu-time`` times the CPU this thread spends (``time.thread_time``, one intra-op thread) instead of wall time,
as ``python -m bench --cpu-time`` does: time spent descheduled by other processes does not inflate it.
``--models`` adds the transformer workloads of ``bench.models`` (whole per-sample-gradient steps: native, use(),
and each composite).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling
from torch import func
from torch.utils.benchmark import Timer

import registry

OP = "scaled_dot_product_attention"
SHAPES = ((64, 4, 32, 16), (64, 4, 128, 16), (64, 8, 64, 32), (256, 2, 16, 16))


def _ms(stmt: Callable[[], object], min_run_time: float, clock: str = "wall") -> float:
    if clock == "cpu":
        stmt()  # warm
        runs, spent = 0, 0.0
        while spent < min_run_time or runs < 3:
            start = time.thread_time()
            stmt()
            spent += time.thread_time() - start
            runs += 1
        return spent / runs * 1e3
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _steps(batch: int, heads: int, length: int, size: int) -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 1, heads, length, size, generator=generator) for _ in range(3))
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    keep = (torch.arange(length) < lengths.unsqueeze(1))[:, None, None, None, :]  # per sample (1, 1, 1, S)

    def attention(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    per_sample_grad = func.vmap(func.grad(lambda q, k, v, m: attention(q, k, v, m).square().sum(),
                                          argnums=(0, 1, 2)))
    forward = func.vmap(attention)
    tangent = func.vmap(lambda q, k, v, m, t: func.jvp(lambda q: attention(q, k, v, m), (q,), (t,))[1])
    return {"vmap": lambda: forward(q, k, v, keep), "vmap(grad)": lambda: per_sample_grad(q, k, v, keep),
            "vmap(jvp)": lambda: tangent(q, k, v, keep, q)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (default 3)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing (default 0.2)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="this thread's CPU time with one intra-op thread, not wall time")
    parser.add_argument("--models", action="store_true", help="also time bench.models' transformer workloads")
    parser.add_argument("--batch", type=int, default=64, help="samples per model step with --models (default 64)")
    args = parser.parse_args(argv)
    clock = "cpu" if args.cpu_time else "wall"
    if args.cpu_time:
        torch.set_num_threads(1)
    ways = {"native": contextlib.nullcontext, "functional": lambda: registry.use(pins={OP: "functional"}),
            "primitive": lambda: registry.use(pins={OP: "primitive"})}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per step (min over rounds)")
    print(f"{'batch x (heads, length, size)':32} {'stack':11} {'native':>9} {'functional':>11} {'primitive':>10}"
          f" {'func/prim':>10} {'native/prim':>12}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for shape in SHAPES:
            for stack, step in _steps(*shape).items():
                best: dict[str, float] = {}
                for _ in range(args.rounds):
                    for way, context in ways.items():
                        with context():
                            if way == "native" and stack == "vmap(jvp)":
                                continue  # natively forward AD of the fused kernel raises
                            best[way] = min(best.get(way, float("inf")),
                                            _ms(step, args.min_run_time, clock))
                native = f"{best['native']:.2f}" if "native" in best else "error"
                ratio = f"{best['native'] / best['primitive']:.2f}x" if "native" in best else "-"
                label = f"{shape[0]} x {shape[1:]}"
                print(f"{label:32} {stack:11} {native:>9} {best['functional']:>11.2f} {best['primitive']:>10.2f}"
                      f" {best['functional'] / best['primitive']:>9.2f}x {ratio:>12}")
        if args.models:
            _models(ways, args, clock)


def _models(ways: dict[str, Callable[[], object]], args: argparse.Namespace, clock: str) -> None:
    from bench.models.transformer import WORKLOADS

    ways = {**ways, "auto": registry.use}
    print(f"\nper-sample-gradient steps, batch {args.batch}: ms per step (min over rounds)")
    print(f"{'workload':34} {'native':>9} {'auto':>9} {'functional':>11} {'primitive':>10} {'native/auto':>12}")
    for workload in WORKLOADS:
        step = workload.build(args.batch).step
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for way, context in ways.items():
                with context():
                    best[way] = min(best.get(way, float("inf")), _ms(step, args.min_run_time, clock))
        print(f"{workload.name:34} {best['native']:>9.1f} {best['auto']:>9.1f} {best['functional']:>11.1f}"
              f" {best['primitive']:>10.1f} {best['native'] / best['auto']:>11.2f}x")


if __name__ == "__main__":
    main()
