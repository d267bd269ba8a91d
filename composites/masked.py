"""Composites of the masked family: ``masked_fill`` and ``masked_scatter``, and the ``Fill`` primitive they share
with ``index_fill``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd import Function

from composites.checks import check_masked_fill, check_masked_scatter, source_too_small
from registry.core.primitive import batch_first, zeros_if_none
from registry.core.registration import register, register_derivative

# Composites call the dispatcher directly, never a covered entry point that use() may have patched,
# and Dynamo traces it under torch.compile.
aten = torch.ops.aten


def scalar_or_tensor(value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a Python number or a tensor) as a tensor of ``like``'s dtype and device, as the native op casts it."""
    if isinstance(value, torch.Tensor):
        if value.dtype == like.dtype and value.device == like.device:
            return value
        return aten._to_copy(value, device=like.device, dtype=like.dtype)
    return torch.scalar_tensor(value, dtype=like.dtype, device=like.device)  # functional under graph capture


class Fill(Function):
    """where(mask, value, self) with its own backward, jvp and vmap rules; mask and value broadcast to self."""

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, value, self)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, mask, value = inputs
        ctx.self_shape, ctx.value_shape = self.shape, value.shape
        ctx.save_for_backward(mask)
        ctx.save_for_forward(self, mask, value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        grad_self = torch.where(mask, 0, grad).sum_to_size(ctx.self_shape)
        grad_value = torch.where(mask, grad, 0).sum_to_size(ctx.value_shape)
        return grad_self, None, grad_value

    @staticmethod
    def jvp(ctx: Any, self_t, _mask_t, value_t) -> torch.Tensor:
        self, mask, value = ctx.saved_tensors
        return torch.where(mask, zeros_if_none(value_t, value), zeros_if_none(self_t, self))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, mask, value):
        rank = max(t.dim() - (d is not None) for t, d in zip((self, mask, value), in_dims, strict=True))
        self, mask, value = batch_first(info, in_dims, self, mask, value, rank=rank)
        return Fill.apply(self, mask, value), 0


# --- masked_fill -------------------------------------------------------------------------------------------------


@register("masked_fill", "native")
def masked_fill_native(self, mask, value):
    """PyTorch's own masked_fill."""
    return aten.masked_fill(self, mask, value)


@register("masked_fill", "mutating")
def masked_fill_mutating(self, mask, value):
    """Clone self (broadcast to the mask), then masked_fill_ in place."""
    check_masked_fill(self, mask, value)
    if mask.shape != self.shape:  # native broadcasts self and mask both ways
        self = self.expand(torch.broadcast_shapes(self.shape, mask.shape))
    # Native returns a contiguous tensor whatever self's strides are.
    return self.clone(memory_format=torch.contiguous_format).masked_fill_(mask, value)


@register("masked_fill", "functional")
def masked_fill_functional(self, mask, value):
    """where(mask, value, self)."""
    check_masked_fill(self, mask, value)
    return torch.where(mask, scalar_or_tensor(value, self), self)


@register("masked_fill", "primitive", function=Fill)
def masked_fill_primitive(self, mask, value):
    """Fill: one autograd node with its own backward, jvp and vmap rules."""
    check_masked_fill(self, mask, value)
    return Fill.apply(self, mask, scalar_or_tensor(value, self))


# --- masked_scatter ----------------------------------------------------------------------------------------------


def scatter_in_order(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, batch_ndim: int) -> torch.Tensor:
    """masked_scatter from out-of-place ops: the k-th True of each sample's mask takes its source's k-th element.

    ``mask`` has ``self``'s shape; the first ``batch_ndim`` dimensions of all three are batch dimensions. The running
    count of Trues indexes a source with one spare element in front, so no position needs clamping.
    """
    lead = self.shape[:batch_ndim]
    flat_mask = mask.reshape(*lead, -1)
    padded_source = torch.nn.functional.pad(source.reshape(*lead, -1), (1, 0))
    position = flat_mask.cumsum(-1, dtype=torch.long)
    return torch.where(mask, padded_source.gather(-1, position).reshape(self.shape), self)


def gather_in_order(values: torch.Tensor, mask: torch.Tensor, source_shape: tuple[int, ...],
                    batch_ndim: int) -> torch.Tensor:
    """The adjoint of ``scatter_in_order`` from out-of-place ops: each sample's values at its Trues, in order, then
    zeros, shaped like source. Positions that are False add zero to a spare slot that is dropped."""
    lead = values.shape[:batch_ndim]
    size = math.prod(source_shape[batch_ndim:])
    flat_mask = mask.reshape(*lead, -1)
    position = torch.where(flat_mask, flat_mask.cumsum(-1, dtype=torch.long) - 1, size)
    picked = torch.where(mask, values, 0).reshape(*lead, -1)
    return values.new_zeros(*lead, size + 1).scatter_add(-1, position, picked)[..., :size].reshape(source_shape)


def _in_order(mask: torch.Tensor, source_size: int, batch_ndim: int) -> torch.Tensor:
    """Per sample, True at the first (number of Trues in the mask) source positions: the source elements used."""
    counts = mask.reshape(*mask.shape[:batch_ndim], -1).sum(-1, keepdim=True)
    return torch.arange(source_size, device=mask.device) < counts


class MaskedScatter(Function):
    """masked_scatter with its own backward, jvp and vmap rules; mask has self's shape.

    The first ``batch_ndim`` dimensions are batch dimensions (the vmap rule adds one). forward runs below every
    transform on plain tensors, so it can use PyTorch's own kernels: the used source elements of every sample are
    compacted, in order, into one flat tensor, and a single native masked_scatter places them all.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, batch_ndim: int) -> torch.Tensor:
        if batch_ndim:
            flat_source = source.reshape(*source.shape[:batch_ndim], -1)
            source = flat_source[_in_order(mask, flat_source.shape[-1], batch_ndim)]
        return aten.masked_scatter(self, mask, source)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, mask, source, ctx.batch_ndim = inputs
        ctx.source_shape = tuple(source.shape)
        ctx.save_for_backward(mask)
        ctx.save_for_forward(mask)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        # Out-of-place ops, which every transform (and Dynamo, which traces no Function applied in a backward)
        # handles; they stay differentiable for higher orders.
        (mask,) = ctx.saved_tensors
        grad_source = gather_in_order(grad, mask, ctx.source_shape, ctx.batch_ndim)
        return torch.where(mask, 0, grad), None, grad_source, None

    @staticmethod
    def jvp(ctx: Any, self_t, _mask_t, source_t, _batch_ndim) -> torch.Tensor:
        # Out-of-place ops, not apply(): Dynamo traces no Function call inside a jvp rule.
        (mask,) = ctx.saved_tensors
        if self_t is None:
            self_t = torch.zeros(mask.shape, dtype=source_t.dtype, device=source_t.device)
        if source_t is None:
            source_t = torch.zeros(ctx.source_shape, dtype=self_t.dtype, device=self_t.device)
        return scatter_in_order(self_t, mask, source_t, ctx.batch_ndim)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, mask, source, batch_ndim):
        self, mask, source = batch_first(info, in_dims[:3], self, mask, source)
        return MaskedScatter.apply(self, mask, source, batch_ndim + 1), 0


def _broadcast_mask(self: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    return self.expand(shape), mask.expand(shape)


@register("masked_scatter", "native")
def masked_scatter_native(self, mask, source):
    """PyTorch's own masked_scatter."""
    return aten.masked_scatter(self, mask, source)


@register("masked_scatter", "mutating")
def masked_scatter_mutating(self, mask, source):
    """Clone self (broadcast to the mask), then masked_scatter_ in place."""
    check_masked_scatter(self, mask, source)
    self, mask = _broadcast_mask(self, mask)
    return self.clone(memory_format=torch.contiguous_format).masked_scatter_(mask, source)


@register("masked_scatter", "functional")
def masked_scatter_functional(self, mask, source):
    """cumsum of the mask picks each source element; gather and where place them."""
    check_masked_scatter(self, mask, source)
    self, mask = _broadcast_mask(self, mask)
    try:
        return scatter_in_order(self, mask, source, 0)
    except RuntimeError as error:  # gather's own bounds check: more Trues than source elements
        source_too_small(error)


@register("masked_scatter", "primitive", function=MaskedScatter)
def masked_scatter_primitive(self, mask, source):
    """MaskedScatter: one autograd node with its own backward, jvp and vmap rules."""
    check_masked_scatter(self, mask, source)
    self, mask = _broadcast_mask(self, mask)
    return MaskedScatter.apply(self, mask, source, 0)


@register_derivative("masked_scatter", "masked_scatter_backward")
def masked_scatter_backward_functional(grad_output, mask, sizes):
    """grad_output's elements where mask is True, in order, zero-padded to sizes: cumsum and scatter_add."""
    grad, mask = _broadcast_mask(grad_output, mask)
    return gather_in_order(grad, mask, tuple(sizes), 0)
