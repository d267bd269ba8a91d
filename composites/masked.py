"""Composites of the masked family: ``masked_fill`` and ``masked_scatter``, and the ``Fill`` primitive they share
with ``index_fill``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd import Function

from composites import fused
from composites.checks import check_masked_fill, check_masked_scatter, source_too_small
from registry.core import rules
from registry.core.primitive import apply, batch_first
from registry.core.registration import define_op, register, register_derivative

# Composites call the dispatcher directly, never a covered entry point that use() may have patched,
# and Dynamo traces it under torch.compile.
aten = torch.ops.aten

# --- the ops: one entry each, with what is known of where PyTorch's own kernel and the clone-and-mutate form fail --

_masked_scatter_backward = rules.backward_without_batching_rule("aten::masked_scatter_backward")

define_op(
    "masked_fill", "Tensor", tensors=("self", "mask", "value"), doc="self with value where mask is True",
    opinfo=("masked_fill",),
    rules={"native": rules.fails_when(lambda ctx: rules.under_vmap(ctx) and "value" in ctx.tensors, "slow",
                                      "aten::masked_fill.Tensor has no batching rule, so vmap runs a per-sample loop")},
)
define_op(
    "masked_scatter", "", tensors=("self", "mask", "source"),
    doc="self with source's elements, in order, where mask is True", opinfo=("masked_scatter",),
    rules={"native": rules.first_of(rules.no_batching_rule("aten::masked_scatter"), _masked_scatter_backward),
           "mutating": _masked_scatter_backward},
)


def scalar_or_tensor(value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a Python number or a tensor) as a tensor of ``like``'s dtype and device, as the native op casts it."""
    if isinstance(value, torch.Tensor):
        if value.dtype == like.dtype and value.device == like.device:
            return value
        return aten._to_copy(value, device=like.device, dtype=like.dtype)
    return torch.scalar_tensor(value, dtype=like.dtype, device=like.device)  # functional under graph capture


class Fill(Function):
    """where(mask, value, self) with its own backward, jvp and vmap rules; mask and value broadcast to self.

    Fused: the body is ``fused.select``, an exact branchless select on the values' bits (``torch.where`` is a branchy
    scalar loop on CPU); ``None`` for ``self`` or ``value`` stands for zero (what backward and jvp pass).
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor | None, mask: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        return fused.select(mask, value, self)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, mask, value = inputs
        ctx.self_shape = None if self is None else self.shape
        ctx.value_shape = None if value is None else value.shape
        ctx.save_for_backward(mask)
        ctx.save_for_forward(mask)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        grad_self = grad_value = None
        if ctx.self_shape is not None and ctx.needs_input_grad[0]:
            grad_self = apply(Fill, grad, mask, None).sum_to_size(ctx.self_shape)
        if ctx.value_shape is not None and ctx.needs_input_grad[2]:
            grad_value = apply(Fill, None, mask, grad).sum_to_size(ctx.value_shape)
        return grad_self, None, grad_value

    @staticmethod
    def jvp(ctx: Any, self_t, _mask_t, value_t) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        if self_t is None and value_t is None:
            raise RuntimeError("Fill.jvp: called without a tangent for self or value")
        return apply(Fill, self_t, mask, value_t)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, mask, value):
        present = [(t, d) for t, d in zip((self, mask, value), in_dims, strict=True) if isinstance(t, torch.Tensor)]
        rank = max(t.dim() - (d is not None) for t, d in present)
        self, mask, value = batch_first(info, in_dims, self, mask, value, rank=rank)
        return apply(Fill, self, mask, value), 0


# --- masked_fill -------------------------------------------------------------------------------------------------


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
    filled = apply(Fill, self, mask, scalar_or_tensor(value, self))
    # Native masked_fill returns a contiguous tensor whatever self's layout; the fused select keeps self's.
    return filled if filled.is_contiguous() else filled.clone(memory_format=torch.contiguous_format)


def laid_out_like(result: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """``result`` with ``self``'s strides, as native index_fill's clone-then-fill gives them (the fused kernels write
    a contiguous result); a contiguous ``self`` costs one check."""
    if result.shape != self.shape or self.is_contiguous():
        return result
    return torch.empty_like(self).copy_(result)


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


class MaskedScatter(Function):
    """masked_scatter with its own backward, jvp and vmap rules; mask has self's shape.

    The first ``batch_ndim`` dimensions are batch dimensions (the vmap rule adds one). Fused: forward runs below
    every transform on plain tensors as ``fused.scatter_in_order`` (a cumsum of the mask picks each True's source
    element with one gather, then an exact branchless select; no ``nonzero`` compaction); backward is two more
    primitives (``Fill`` for self, ``MaskedGather`` for source), so it is fused under vmap too and differentiable again.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, batch_ndim: int) -> torch.Tensor:
        return fused.scatter_in_order(self, mask, source, batch_ndim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, mask, source, ctx.batch_ndim = inputs
        ctx.source_shape = tuple(source.shape)
        ctx.save_for_backward(mask)
        ctx.save_for_forward(mask)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        grad_self = apply(Fill, grad, mask, None) if ctx.needs_input_grad[0] else None
        grad_source = (apply(MaskedGather, grad, mask, ctx.source_shape, ctx.batch_ndim) if ctx.needs_input_grad[2]
                       else None)
        return grad_self, None, grad_source, None

    @staticmethod
    def jvp(ctx: Any, self_t, _mask_t, source_t, _batch_ndim) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        if self_t is None:
            self_t = torch.zeros(mask.shape, dtype=source_t.dtype, device=source_t.device)
        if source_t is None:
            source_t = torch.zeros(ctx.source_shape, dtype=self_t.dtype, device=self_t.device)
        return apply(MaskedScatter, self_t, mask, source_t, ctx.batch_ndim)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, mask, source, batch_ndim):
        self, mask, source = batch_first(info, in_dims[:3], self, mask, source)
        return apply(MaskedScatter, self, mask, source, batch_ndim + 1), 0


class MaskedGather(Function):
    """The adjoint of MaskedScatter for source: each sample's values at its mask's Trues, in order, then zeros."""

    generate_vmap_rule = False

    @staticmethod
    def forward(values: torch.Tensor, mask: torch.Tensor, source_shape: tuple[int, ...],
                batch_ndim: int) -> torch.Tensor:
        return fused.gather_in_order(values, mask, source_shape, batch_ndim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        values, mask, ctx.source_shape, ctx.batch_ndim = inputs
        ctx.values_shape = tuple(values.shape)
        ctx.save_for_backward(mask)
        ctx.save_for_forward(mask)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        zeros = torch.zeros(ctx.values_shape, dtype=grad.dtype, device=grad.device)
        return apply(MaskedScatter, zeros, mask, grad, ctx.batch_ndim), None, None, None

    @staticmethod
    def jvp(ctx: Any, values_t, _mask_t, _source_shape, _batch_ndim) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return apply(MaskedGather, values_t, mask, ctx.source_shape, ctx.batch_ndim)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], values, mask, source_shape, batch_ndim):
        values, mask = batch_first(info, in_dims[:2], values, mask)
        return apply(MaskedGather, values, mask, (info.batch_size, *source_shape), batch_ndim + 1), 0


def _broadcast_mask(self: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    return self.expand(shape), mask.expand(shape)


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
    shape = fused.broadcast_shape(self.shape, mask.shape)
    return apply(MaskedScatter, self.expand(shape), mask.expand(shape), source, 0)


@register_derivative("masked_scatter", "masked_scatter_backward")
def masked_scatter_backward_functional(grad_output, mask, sizes):
    """grad_output's elements where mask is True, in order, zero-padded to sizes: cumsum and scatter_add."""
    grad, mask = _broadcast_mask(grad_output, mask)
    size = math.prod(sizes)
    flat_mask = mask.reshape(-1)
    position = torch.where(flat_mask, flat_mask.cumsum(-1) - 1, size)  # False positions add to a dropped spare slot
    picked = torch.where(flat_mask, grad.reshape(-1), 0)
    return grad.new_zeros(size + 1).scatter_add(0, position, picked)[:size].reshape(tuple(sizes))
