"""What running library machinery under transforms costs inside ``use()`` (``python -m bench.functions``):
pre-2.0 autograd.Functions, activation checkpointing, flex_attention under vmap. docs/functions.md quotes it.

Thread CPU time (``time.thread_time``), one intra-op thread, interleaved rounds (``registry.profiling.noise``); each
line gives the min and the median of the rounds, per call.

(1) ``Function.apply`` of a new-style Function outside ``use()``, eager: the patched code vs PyTorch's own code.
(2) a pre-2.0 radial basis (hand-written backward) under vmap(grad), batch 64: inside ``use()`` (adapted) vs the same
    Function written new-style (``setup_context``, ``generate_vmap_rule``) natively vs the per-sample autograd loop.
(3) a checkpointed MLP under vmap(grad), batch 64: inside ``use()`` (activations kept) vs the un-checkpointed
    program, natively and inside ``use()``.
(4) flex_attention with a score mod and a block mask under vmap over 8 samples inside ``use()`` vs a Python loop of
    8 calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import func
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

import registry
from registry.core import legacy_functions
from registry.profiling import noise

BATCH = 64


class NewStyle(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class OldRadialBasis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, centers, gamma):
        diff = r[..., None] - centers
        y = torch.exp(-gamma * diff * diff)
        ctx.save_for_backward(diff, y)
        ctx.gamma = gamma
        return y

    @staticmethod
    def backward(ctx, grad):
        diff, y = ctx.saved_tensors
        return (grad * y * (-2 * ctx.gamma) * diff).sum(-1), None, None


class NewRadialBasis(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(r, centers, gamma):
        diff = r[..., None] - centers
        return torch.exp(-gamma * diff * diff)

    @staticmethod
    def setup_context(ctx, inputs, output):
        r, centers, gamma = inputs
        ctx.save_for_backward(r[..., None] - centers, output)
        ctx.gamma = gamma

    @staticmethod
    def backward(ctx, grad):
        diff, y = ctx.saved_tensors
        return (grad * y * (-2 * ctx.gamma) * diff).sum(-1), None, None


def _line(name: str, timed: noise.Timed, base: noise.Timed | None = None) -> str:
    low, mid = min(timed.rounds_us), statistics.median(timed.rounds_us)
    ratio = "" if base is None else f"  ({mid / statistics.median(base.rounds_us):.2f}x)"
    return f"  {name:<34} min {low:10.1f} us  median {mid:10.1f} us{ratio}"


def _run(title: str, runners: dict[str, Callable[[], Any]], rounds: int, base: str) -> None:
    timed = noise.interleaved(runners, rounds=rounds, min_run_time=0.2 * rounds, clock=time.thread_time)
    print(title)
    for name in runners:
        print(_line(name, timed[name], None if name == base else timed[base]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    registry.use()  # installs the patches
    x = torch.randn(4)
    _run("(1) Function.apply, new-style, eager, outside use()", {
        "PyTorch's apply": lambda: legacy_functions.pytorch_apply(NewStyle, x),
        "patched apply": lambda: NewStyle.apply(x),
    }, args.rounds, "PyTorch's apply")

    g = torch.Generator().manual_seed(0)
    edges = torch.rand(BATCH, 32, generator=g) * 2
    centers = torch.linspace(0.0, 2.0, 8)
    old_loss = lambda r: OldRadialBasis.apply(r, centers, 1.5).sin().sum()  # noqa: E731
    new_loss = lambda r: NewRadialBasis.apply(r, centers, 1.5).sin().sum()  # noqa: E731
    inside = registry.use()

    def adapted() -> Any:
        with inside:
            return func.vmap(func.grad(old_loss))(edges)

    def loop() -> Any:
        out = []
        for r in edges:
            r = r.clone().requires_grad_()
            out.append(torch.autograd.grad(old_loss(r), r)[0])
        return torch.stack(out)

    _run(f"(2) pre-2.0 radial basis under vmap(grad), batch {BATCH}", {
        "new-style Function, native": lambda: func.vmap(func.grad(new_loss))(edges),
        "pre-2.0 Function, inside use()": adapted,
        "per-sample autograd loop": loop,
    }, args.rounds, "new-style Function, native")

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    samples = torch.randn(BATCH, 64)
    plain = lambda v: mlp(v).pow(2).sum()  # noqa: E731
    checkpointed = lambda v: checkpoint(mlp, v, use_reentrant=False).pow(2).sum()  # noqa: E731

    def kept() -> Any:
        with inside:
            return func.vmap(func.grad(checkpointed))(samples)

    def plain_inside() -> Any:
        with inside:
            return func.vmap(func.grad(plain))(samples)

    _run(f"(3) checkpointed MLP under vmap(grad), batch {BATCH}", {
        "un-checkpointed, native": lambda: func.vmap(func.grad(plain))(samples),
        "un-checkpointed, inside use()": plain_inside,
        "checkpointed, inside use()": kept,
    }, args.rounds, "un-checkpointed, native")

    q = torch.randn(8, 2, 2, 64, 16)
    bias = torch.randn(2, 2)
    block_mask = create_block_mask(lambda b, h, m, n: m >= n, 2, 2, 64, 64, device="cpu", BLOCK_SIZE=32)
    attend = lambda t: flex_attention(t, t, t, score_mod=lambda s, b, h, m, n: s + bias[b, h],  # noqa: E731
                                      block_mask=block_mask)

    def folded() -> Any:
        with inside:
            return func.vmap(attend)(q)

    _run("(4) flex_attention over 8 samples", {
        "Python loop of 8 calls": lambda: torch.stack([attend(t) for t in q]),
        "vmap inside use()": folded,
    }, args.rounds, "Python loop of 8 calls")


if __name__ == "__main__":
    main()
