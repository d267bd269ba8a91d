"""Composites of the pooling family: ``max_unpool2d``, ``max_unpool3d``, ``fractional_max_pool2d``/``3d``.

``max_unpool1d`` reaches ``max_unpool2d`` (PyTorch unsqueezes it), so one entry covers both.
"""

from __future__ import annotations

import math

import torch

from registry.core import rules
from registry.core.cost import batch_and_numel
from registry.core.registration import define_op, register

aten = torch.ops.aten

_UNPOOL_DUPLICATES = ("max_unpool's forward-AD formula scatters the tangents (one of the duplicate indices wins) while "
                      "its backward gathers (every duplicate gets the gradient): jacfwd and vmap(jvp) disagree with "
                      "jacrev wherever indices repeat")


_jvp_under_vmap = rules.under_vmap_with("jvp")


for _name in ("max_unpool2d", "max_unpool3d"):
    define_op(
        _name, "", tensors=("self", "indices"),
        doc=f"self written at the flat positions indices of each channel of an output of output_size ({_name})",
        opinfo=(("nn.functional.max_unpool1d", "nn.functional.max_unpool1d.grad", "nn.functional.max_unpool2d",
                 "nn.functional.max_unpool2d.grad") if _name == "max_unpool2d"
                else ("nn.functional.max_unpool3d", "nn.functional.max_unpool3d.grad")),
        inplace=False,
        rules={"native": rules.first_of(rules.fails_when(_jvp_under_vmap, "mismatch", _UNPOOL_DUPLICATES),
                                        rules.no_batching_rule(f"aten::{_name}"))},
        sizes=batch_and_numel,  # NOTE: vmap's loop beats the composite over a few small samples: by cost
    )


def unpool(self: torch.Tensor, indices: torch.Tensor, output_size) -> torch.Tensor:
    """Scatter each channel's values to its flat indices in a zero output.

    The value is ``scatter``'s (where indices repeat, the last write wins, as PyTorch's kernel on one thread); the
    derivatives are ``scatter_add``'s in both modes: the backward gathers, as PyTorch's, and the tangent is the sum of
    the duplicates' tangents, so that jacfwd equals jacrev (PyTorch's forward AD keeps one of them).
    """
    spatial = len(output_size)
    lead = self.shape[:-spatial]
    values = self.reshape(*lead, -1)
    flat = indices.reshape(*lead, -1)
    zeros = self.new_zeros(*lead, math.prod(output_size))
    written = zeros.scatter(-1, flat, values.detach())
    summed = zeros.scatter_add(-1, flat, values)
    return (written + (summed - summed.detach())).reshape(*lead, *output_size)


@register("max_unpool2d", "functional")
def max_unpool2d_functional(self, indices, output_size):
    """scatter into a zero output, with scatter_add's derivatives (see unpool)."""
    if self.dim() not in (3, 4) or indices.shape != self.shape:
        return aten.max_unpool2d(self, indices, output_size)  # PyTorch's own checks, so that the error is the same
    return unpool(self, indices, output_size)


@register("max_unpool3d", "functional")
def max_unpool3d_functional(self, indices, output_size, stride, padding):
    """scatter into a zero output, with scatter_add's derivatives (see unpool)."""
    if self.dim() not in (4, 5) or indices.shape != self.shape:
        return aten.max_unpool3d(self, indices, output_size, stride, padding)
    return unpool(self, indices, output_size)


for _name in ("fractional_max_pool2d", "fractional_max_pool3d"):
    define_op(
        _name, "", tensors=("self", "random_samples"),
        doc=f"the maximum of each pseudo-random pooling region of self, and its flat index ({_name})",
        opinfo=(f"nn.functional.{_name}",), inplace=False,
        rules={"native": rules.backward_without_batching_rule(f"aten::{_name}_backward")},
    )


def _gather_pooled(self: torch.Tensor, indices: torch.Tensor, spatial: int) -> torch.Tensor:
    """self's values at the flat per-channel indices: gather's backward (scatter_add) batches."""
    values = self.flatten(-spatial).gather(-1, indices.flatten(-spatial))
    return values.reshape(indices.shape)


@register("fractional_max_pool2d", "functional")
def fractional_max_pool2d_functional(self, kernel_size, output_size, random_samples):
    """PyTorch's kernel (which batches) picks the indices without autograd; the values are gathered at them."""
    indices = aten.fractional_max_pool2d(self.detach(), kernel_size, output_size, random_samples)[1]
    return _gather_pooled(self, indices, 2), indices


@register("fractional_max_pool3d", "functional")
def fractional_max_pool3d_functional(self, kernel_size, output_size, random_samples):
    """PyTorch's kernel (which batches) picks the indices without autograd; the values are gathered at them."""
    indices = aten.fractional_max_pool3d(self.detach(), kernel_size, output_size, random_samples)[1]
    return _gather_pooled(self, indices, 3), indices
