"""Composites of the index family: ``index_add``, ``index_copy``, ``index_fill``.

The functional and primitive composites work in scatter form: the 1-D ``index`` is expanded to the shape of
``source`` along ``dim``, which makes them closed under batching (a batched index is just one more dimension).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from composites.checks import (
    check_index_add,
    check_index_copy,
    check_index_fill,
    index_out_of_bounds,
    native_alpha,
)
from composites.masked import Fill, scalar_or_tensor
from registry.core.primitive import batch_first, zeros_if_none
from registry.core.registration import register

# Composites call the dispatcher directly, never a covered entry point that use() may have patched,
# and Dynamo traces it under torch.compile.
aten = torch.ops.aten


def _rank1_view(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor | None):
    """0-d and 1-d inputs viewed as 1-d with dim 0, other inputs with ``dim`` made non-negative."""
    if self.dim() <= 1:
        return self.reshape(-1), 0, index.reshape(-1), None if source is None else source.reshape(-1)
    return self, dim % self.dim(), index.reshape(-1), source


def _scatter_index(index: torch.Tensor, source: torch.Tensor, dim: int) -> torch.Tensor:
    """The 1-d ``index`` broadcast to ``source``'s shape along ``dim``: what ``scatter``/``gather`` take."""
    shape = [1] * source.dim()
    shape[dim] = -1
    return index.reshape(shape).expand_as(source)


# --- index_add ---------------------------------------------------------------------------------------------------


@register("index_add", "native")
def index_add_native(self, dim, index, source, *, alpha=1):
    """PyTorch's own index_add."""
    return aten.index_add(self, dim, index, source, alpha=alpha)


@register("index_add", "mutating")
def index_add_mutating(self, dim, index, source, *, alpha=1):
    """Clone self, then index_add_ in place."""
    check_index_add(self, dim, index, source, alpha)
    # Native returns a contiguous tensor whatever self's strides are.
    return self.clone(memory_format=torch.contiguous_format).index_add_(dim, index, source, alpha=alpha)


@register("index_add", "functional")
def index_add_functional(self, dim, index, source, *, alpha=1):
    """scatter_add of alpha * source at the expanded index."""
    check_index_add(self, dim, index, source, alpha)
    alpha = native_alpha(self, alpha)
    flat, dim_, index_, source_ = _rank1_view(self, dim, index, source)
    scaled = source_ if alpha == 1 else source_ * alpha
    return flat.scatter_add(dim_, _scatter_index(index_, source_, dim_), scaled).reshape(self.shape)


class IndexAdd(Function):
    """self.scatter_add(dim, index, alpha * source) with its own backward, jvp and vmap rules (index: scatter form)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, alpha: Any) -> torch.Tensor:
        return self.scatter_add(dim, index, source if alpha == 1 else source * alpha)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, ctx.dim, index, source, ctx.alpha = inputs
        ctx.save_for_backward(index)
        ctx.save_for_forward(self, index, source)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_source = grad.gather(ctx.dim, index)
        return grad, None, None, grad_source if ctx.alpha == 1 else grad_source * ctx.alpha, None

    @staticmethod
    def jvp(ctx: Any, self_t, _dim, _index, source_t, _alpha) -> torch.Tensor:
        self, index, source = ctx.saved_tensors
        added = zeros_if_none(source_t, source)
        added = added if ctx.alpha == 1 else added * ctx.alpha
        return zeros_if_none(self_t, self).scatter_add(ctx.dim, index, added)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, dim, index, source, alpha):
        self, index, source = batch_first(info, (in_dims[0], in_dims[2], in_dims[3]), self, index, source)
        return IndexAdd.apply(self, dim + 1, index, source, alpha), 0


@register("index_add", "primitive", function=IndexAdd)
def index_add_primitive(self, dim, index, source, *, alpha=1):
    """IndexAdd: one autograd node with its own backward, jvp and vmap rules."""
    check_index_add(self, dim, index, source, alpha)
    alpha = native_alpha(self, alpha)
    flat, dim_, index_, source_ = _rank1_view(self, dim, index, source)
    return IndexAdd.apply(flat, dim_, _scatter_index(index_, source_, dim_), source_, alpha).reshape(self.shape)


# --- index_copy --------------------------------------------------------------------------------------------------


@register("index_copy", "native")
def index_copy_native(self, dim, index, source):
    """PyTorch's own index_copy."""
    return aten.index_copy(self, dim, index, source)


@register("index_copy", "mutating")
def index_copy_mutating(self, dim, index, source):
    """Clone self, then index_copy_ in place."""
    check_index_copy(self, dim, index, source)
    # Native returns a contiguous tensor whatever self's strides are.
    return self.clone(memory_format=torch.contiguous_format).index_copy_(dim, index, source)


@register("index_copy", "functional")
def index_copy_functional(self, dim, index, source):
    """scatter of source at the expanded index."""
    check_index_copy(self, dim, index, source)
    flat, dim_, index_, source_ = _rank1_view(self, dim, index, source)
    try:
        return flat.scatter(dim_, _scatter_index(index_, source_, dim_), source_).reshape(self.shape)
    except RuntimeError as error:  # scatter's own bounds check: native raises IndexError
        index_out_of_bounds("index_copy", dim, flat.shape[dim_], error)


class IndexCopy(Function):
    """self.scatter(dim, index, source) with its own backward, jvp and vmap rules (index: scatter form)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.scatter(dim, index, source)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, ctx.dim, index, source = inputs
        ctx.save_for_backward(index)
        ctx.save_for_forward(self, index, source)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        # Positions that source overwrote get no gradient from self.
        return grad.scatter(ctx.dim, index, 0), None, None, grad.gather(ctx.dim, index)

    @staticmethod
    def jvp(ctx: Any, self_t, _dim, _index, source_t) -> torch.Tensor:
        self, index, source = ctx.saved_tensors
        return zeros_if_none(self_t, self).scatter(ctx.dim, index, zeros_if_none(source_t, source))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, dim, index, source):
        self, index, source = batch_first(info, (in_dims[0], in_dims[2], in_dims[3]), self, index, source)
        return IndexCopy.apply(self, dim + 1, index, source), 0


@register("index_copy", "primitive", function=IndexCopy)
def index_copy_primitive(self, dim, index, source):
    """IndexCopy: one autograd node with its own backward, jvp and vmap rules."""
    check_index_copy(self, dim, index, source)
    flat, dim_, index_, source_ = _rank1_view(self, dim, index, source)
    try:
        return IndexCopy.apply(flat, dim_, _scatter_index(index_, source_, dim_), source_).reshape(self.shape)
    except RuntimeError as error:  # scatter's own bounds check: native raises IndexError
        index_out_of_bounds("index_copy", dim, flat.shape[dim_], error)


# --- index_fill --------------------------------------------------------------------------------------------------


def _index_mask(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """A bool mask, broadcastable to ``self``, that is True at ``index`` along ``dim``.

    Indices in [-size, size) are valid, as in native. Shifted by ``size`` they land in [0, 2 * size), where scatter's
    own bounds check rejects every other index (under vmap too, where no data-dependent check could run here); the
    two halves are then folded onto one.
    """
    size = self.shape[dim] if self.dim() else 1
    try:
        hits = torch.zeros(2 * size, dtype=torch.bool, device=self.device).scatter(0, index.reshape(-1) + size, True)
    except RuntimeError as error:
        index_out_of_bounds("index_fill", dim, size, error, negative=True)
    hits = hits.reshape(2, size).any(0)
    if self.dim() == 0:
        return hits.reshape(())
    return hits.reshape((-1,) + (1,) * (self.dim() - dim % self.dim() - 1))


@register("index_fill", "native")
def index_fill_native(self, dim, index, value):
    """PyTorch's own index_fill."""
    return aten.index_fill(self, dim, index, value)


@register("index_fill", "mutating")
def index_fill_mutating(self, dim, index, value):
    """Clone self, then index_fill_ in place."""
    check_index_fill(self, dim, index, value)
    return self.clone().index_fill_(dim, index, value)


@register("index_fill", "functional")
def index_fill_functional(self, dim, index, value):
    """where(mask of index along dim, value, self)."""
    check_index_fill(self, dim, index, value)
    return torch.where(_index_mask(self, dim, index), scalar_or_tensor(value, self), self)


@register("index_fill", "primitive", function=Fill)
def index_fill_primitive(self, dim, index, value):
    """Fill at the mask of index along dim: one autograd node with its own backward, jvp and vmap rules."""
    check_index_fill(self, dim, index, value)
    return Fill.apply(self, _index_mask(self, dim, index), scalar_or_tensor(value, self))
