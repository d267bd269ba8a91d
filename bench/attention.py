"""``python -m bench.attention``: scaled_dot_product_attention's composites against each other and native, per stack.

Each shape is a batch of per-sample (heads, length, head size) attentions with a key padding mask, under vmap,
vmap(grad) and jacfwd's vmap(jvp): native (outside ``use()``), and the functional and primitive composites pinned
inside ``use()``, timed in alternating rounds in one process; the ratio is the functional composite's time over the
primitive's (above 1: the fused primitive is faster), which is what ``define_op(..., preference=...)`` encodes.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling
from torch import func
from torch.utils.benchmark import Timer

import registry

OP = "scaled_dot_product_attention"
SHAPES = ((64, 4, 32, 16), (64, 4, 128, 16), (64, 8, 64, 32), (256, 2, 16, 16))


def _ms(stmt: Callable[[], object], min_run_time: float) -> float:
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
    args = parser.parse_args(argv)
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
                            best[way] = min(best.get(way, float("inf")), _ms(step, args.min_run_time))
                native = f"{best['native']:.2f}" if "native" in best else "error"
                ratio = f"{best['native'] / best['primitive']:.2f}x" if "native" in best else "-"
                label = f"{shape[0]} x {shape[1:]}"
                print(f"{label:32} {stack:11} {native:>9} {best['functional']:>11.2f} {best['primitive']:>10.2f}"
                      f" {best['functional'] / best['primitive']:>9.2f}x {ratio:>12}")


if __name__ == "__main__":
    main()
