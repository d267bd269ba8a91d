"""Composites of the linear family: ``linear`` (``nn.Linear``, ``F.linear``) as one op of our own under vmap(grad).

PyTorch's ``aten::linear`` is CompositeImplicitAutograd: under torch.func's grad it decomposes at the grad level into
``t``, ``view`` or ``reshape``, ``addmm`` or ``matmul`` and ``add``, each recorded as its own node and batched on its
own one level below, forward and backward; a per-sample-gradient step pays that machinery on every linear layer.
The ``cpp_op`` composite is ``multicomposite::linear`` (``registry/core/kernels/linear.cpp``): one node whose
backward differentiates again, a forward-AD tangent in aten ops, and a batching rule that folds
the batch into the rows in one call of PyTorch's linear. It takes the call's own arguments, so the C++ routing calls
it without entering Python (``redirect``).

A weight used by several calls of one graph (a recurrence written with ``nn.Linear``: opacus's DPLSTM) gets its
gradient from one node that forms it once from every call's rows, where autograd summed one per-sample gradient per
call out of place (the kernel's NOTE).

Measured (``python -m bench.models --pins '{"linear": "native"}'``, ``docs/benchmarks.md``, thread CPU time, one
thread): a LoRA-adapted decoder's per-sample-gradient step at batch 4 5.61 -> 4.83 ms, opacus's DPLSTM at batch 64
22.9 -> 10.5 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from composites.our_ops import OPS as CPP_OPS
from registry.core import kernels, rules
from registry.core.context import Context
from registry.core.registration import define_op, register

_SHAPES_EVIDENCE = ("multicomposite::linear takes a 2-d weight and an input of at least one dimension; PyTorch's "
                    "linear takes a 1-d weight too")


def _takes(input_rank: int, weight_rank: int) -> bool:
    """Whether the C++ op takes an input and a weight of these ranks (it checks the same itself)."""
    return weight_rank == 2 and input_rank >= 1


def _shapes_outside_the_op(ctx: Context) -> bool:
    """Whether the call's per-sample shapes, where the context has them, are ones the C++ op refuses."""
    shapes = dict(zip(ctx.tensors, ctx.shapes, strict=False))
    weight, input_ = shapes.get("weight"), shapes.get("input")  # either may be unknown (select() without sizes)
    return not _takes(1 if input_ is None else len(input_), 2 if weight is None else len(weight))


def _per_sample_gradients(ctx: Context) -> rules.Order | None:
    # Only under vmap(grad) and vmap(jacrev), one level that differentiates: elsewhere PyTorch's decomposition costs
    # what the op does (plain vmap folds it the same way) and stays PyTorch's.
    # An input the samples share (an LSTM's initial hidden state) too: the op forms each sample's weight gradient as
    # an outer product where PyTorch's mm multiplies with a contracted size of 1.
    if rules.per_sample_gradients(ctx):
        return rules.Order(("cpp_op", "native"),
                           "under vmap(grad) PyTorch's linear decomposes into t, view, addmm and add, each a node and "
                           "a batched call of its own; the C++ op records one node, folds the batch into one call and "
                           "forms each sample's weight gradient as one product")
    return None


define_op(
    "linear", "", tensors=("input", "weight", "bias"),
    doc="input times weight transposed, plus bias: y = x W^T + b over the last dimension",
    opinfo=("nn.functional.linear",), inplace=False,
    rules={"cpp_op": rules.fails_when(_shapes_outside_the_op, "error", _SHAPES_EVIDENCE)},
    preference=_per_sample_gradients,
)


@register("linear", "cpp_op", redirect="multicomposite::linear")
def linear_cpp_op(input, weight, bias=None):
    """multicomposite::linear (registry/core/kernels/linear.cpp): one node with a differentiable backward, a forward-AD
    tangent, and a batching rule that folds the batch into the rows."""
    return CPP_OPS.get().linear.default(input, weight, bias)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, as the C++ op wherever it takes the call: for composites that compute linear maps themselves.

    Inside a composite the routing passes every call to PyTorch's own kernel, so ``F.linear`` there is PyTorch's
    linear; a recurrence's cells (``composites/recurrent.py``) use each weight at every step, whose per-sample
    gradients the op's weight-gradient node forms once over the steps. The same conditions as the composite's: the
    ranks the op takes, not while torch.compile traces and only where the op is built (the cpp_op kind's rule).
    """
    if _takes(input.dim(), weight.dim()) and not torch.compiler.is_compiling() and kernels.fused_ops_available():
        return CPP_OPS.get().linear.default(input, weight, bias)
    return F.linear(input, weight, bias)
