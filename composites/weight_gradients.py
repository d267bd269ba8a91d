"""Per-sample weight gradients: the products and reductions autograd's backward forms them with, under vmap.

Under ``vmap(grad)`` (and ``vmap(jacrev)``) each sample's gradient of a weight it shares with the others is formed by
the weight's backward formula on that sample's activations and output gradients, and vmap batches it: ``nn.Linear``'s
weight gradient is ``mm`` of the output gradient ``(out, 1)`` with the input ``(1, in)`` (a sample is a batch of
one), which vmap runs as ``bmm`` of ``(B, out, 1) x (B, 1, in)``. The routing catches those calls where they are made,
in C++, inside autograd's backward; a decision here keeps PyTorch's own kernel for every call that is not such a
product (an unbatched operand: the forward's activations times a shared weight) and, inside the composite, for
every shape whose contraction is not over a single element.

Measured (``python -m bench.models``, ``docs/benchmarks.md``): a contraction over one element computed as a
broadcasting multiply writes each per-sample gradient once, where ``bmm`` with a contracted size of 1 runs a
general matrix product per sample.
"""

from __future__ import annotations

import torch

from registry.core import rules
from registry.core.context import Context
from registry.core.registration import define_op, register

# Composites call the dispatcher directly: inside a composite the routing passes calls through to PyTorch's kernel.
aten = torch.ops.aten


def _both_batched(*names: str):
    """An Order that puts the per-sample product first where every one of ``names`` is batched under vmap: there
    the call may be a per-sample weight gradient (each sample's own output gradient times its own activations)."""

    def order(ctx: Context) -> rules.Order | None:
        if rules.under_vmap(ctx) and all(name in ctx.batched for name in names) and _may_be_outer(ctx):
            return rules.Order(("functional", "native", "primitive", "mutating"),
                               f"under vmap with {' and '.join(names)} batched the call may be a per-sample weight "
                               "gradient, a contraction over one element: the functional composite writes it as "
                               "one broadcasting multiply and runs PyTorch's own kernel for every other shape")
        return None

    return order


def _may_be_outer(ctx: Context) -> bool:
    """Whether the call's per-sample shapes, where the context has them (a routed call does; ``select`` without
    sizes does not), contract over a single element: the only shapes the composite computes itself. Elsewhere it
    would run PyTorch's mm after a Python frame, about 25 us a call (``multihead-attention-sdpa`` at batch 4 ran 0.95x
    native with it). The routing key holds each dimension's bit length, which tells a size of 1 from any other, so
    a cached decision never crosses that line."""
    shapes = dict(zip(ctx.tensors, ctx.shapes, strict=False))
    first, second = shapes.get("self"), shapes.get("mat2")
    if first is None or second is None:
        return True
    return _outer_shapes(first, second)


define_op("mm", "", tensors=("self", "mat2"), doc="the matrix product of self (n x k) and mat2 (k x m)",
          opinfo=("mm",), inplace=False, preference=_both_batched("self", "mat2"))


def _contracts_one(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` (matrices, or batches of them) contracts over a single element and needs no type
    promotion: an outer product, which a broadcasting multiply computes exactly (one product per element)."""
    return _outer_shapes(a.shape, b.shape) and a.dtype == b.dtype


def _outer_shapes(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether matrices (or batches of them) of shapes ``a`` and ``b`` multiply as an outer product."""
    return len(a) == len(b) and len(a) >= 2 and a[-1] == 1 and b[-2] == 1


@register("mm", "functional")
def mm_functional(self, mat2):
    """``self * mat2`` where the contraction is over one element (``(n, 1) x (1, m)``: nn.Linear's per-sample weight
    gradient under vmap(grad)), else PyTorch's own mm."""
    if _contracts_one(self, mat2):
        return self * mat2
    return aten.mm(self, mat2)
