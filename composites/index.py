"""Composites of the index family: ``index_add``, ``index_copy``, ``index_fill``.

The functional and primitive composites work in scatter form: the 1-D ``index`` is expanded to the shape of
``source`` along ``dim``, which makes them closed under batching (a batched index is just one more dimension).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Function

from composites import fused
from composites.checks import (
    check_index_add,
    check_index_copy,
    check_index_fill,
    index_out_of_bounds,
    native_alpha,
)
from composites.masked import Fill, laid_out_like, scalar_or_tensor
from composites.our_ops import OPS as CPP_OPS
from registry.core import rules
from registry.core.context import Context
from registry.core.primitive import apply, batch_first, zeros_if_none
from registry.core.registration import define_op, register
from registry.core.rules import Problem

# Composites call the dispatcher directly, never a covered entry point that use() may have patched,
# and Dynamo traces it under torch.compile.
aten = torch.ops.aten


# --- the ops: one entry each, with what is known of where PyTorch's own kernel and the clone-and-mutate form fail --


def _index_fill_derivative(ctx: Context) -> Problem | None:
    """index_fill's derivative formulas, shared by the native op and its in-place form: they index with the raw,
    negative, index. The gradient of a tensor value always does, and functorch's grad and jvp do for self too."""
    if "grad" in ctx.stack or "jvp" in ctx.stack or ("autograd" in ctx.stack and "value" in ctx.tensors):
        return Problem("error", "index_fill's derivative formulas fail on negative indices (INDICES element is "
                                "out of DATA bounds) under torch.func grad and jvp, and for a tensor value")
    return None


def _index_fill_native(ctx: Context) -> Problem | None:
    if not rules.under_vmap(ctx):
        return _index_fill_derivative(ctx)
    if "value" in ctx.tensors and not ctx.self_covers_batching:
        return Problem("mismatch", "index_fill with a batched value into an unbatched self returns wrong values "
                                   "under vmap")
    return Problem("error", "index_fill decomposes to index_fill_, which vmap rejects under vmap(jacfwd) and "
                            "vmap(vmap) and loops over with a tensor value")


def rows_under_per_sample_gradients(op: str) -> Callable[[Context], rules.Order | None]:
    """The preference of the ops whose cpp_op composite is a rows op (``registry/core/kernels/rows.cpp``, NOTE
    [rows ops]): under vmap(grad) and vmap(jacrev), one level that differentiates, with the index batched (each
    sample's own: message passing), the cpp_op composite first; elsewhere the general order. With an index the
    samples share, functorch's rules need no loop and the rows op is slower (index_add at 256 x 1,000 under
    vmap(grad): 796 us against native's 524, the reference profiles)."""
    reason = (f"under vmap(grad) functorch batches {op} with the index batched as a loop over the samples or a "
              "scatter with the batched index, and its backward as a gather with it; the rows op folds the batch "
              "into the rows in one pass, and its backward is the other rows op")

    def preference(ctx: Context) -> rules.Order | None:
        # (Under torch.compile the cpp_op kind's own rule makes it invalid.)
        if rules.per_sample_gradients(ctx) and _index_batched(ctx):
            return rules.Order(("cpp_op", "native"), reason)
        return None

    return preference


def _index_batched(ctx: Context) -> bool:
    """Under vmap with the index batched (nested vmaps and torch.compile's hidden stack counted as batched: the
    context names the arguments batched at the innermost level only)."""
    return rules.under_vmap(ctx) and ("index" in ctx.batched or ctx.stack.count("vmap") > 1 or "compile" in ctx.stack)


# NOTE [index_add's batched index]: functorch's index_add batching rule has no batched form of a batched index: it
# runs index_add once per sample, a loop in C++ that warns of nothing. Graph networks aggregate messages that way
# (``out.index_add_(0, edge_target, messages)``, the edges each sample's own). Measured, thread CPU time, one thread,
# 12 x 16 rows, 42 edges: under vmap(grad) native 213 / 292 / 612 us at batch 4 / 16 / 64 against the scatter_add
# composite's 204 / 213 / 262; under vmap 70 / 145 / 448 against 60 / 66 / 110.
define_op("index_add", "", tensors=("self", "index", "source"), doc="self with alpha * source added at index along dim",
          opinfo=("index_add",), preference=rows_under_per_sample_gradients("index_add"),
          rules={"native": rules.fails_when(
              _index_batched, "slow", "functorch's index_add batching rule runs index_add once per sample where the "
                                      "index is batched (a loop in C++, without vmap's warning)")})
define_op("index_copy", "", tensors=("self", "index", "source"), doc="self with source copied to index along dim",
          opinfo=("index_copy",))
# index_fill's Tensor-value overloads also get a kernel at the Autograd key: their gradient fails even in eager
# autograd ("index out of range").
define_op("index_fill", "int_Tensor", tensors=("self", "index", "value"),
          doc="self with value written at index along dim", opinfo=("index_fill",),
          eager_autograd=("index_fill.int_Tensor", "index_fill_.int_Tensor"),
          rules={"native": _index_fill_native, "mutating": _index_fill_derivative})


def rank1_view(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor | None):
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
    flat, dim_, index_, source_ = rank1_view(self, dim, index, source)
    scaled = source_ if alpha == 1 else source_ * alpha
    return flat.scatter_add(dim_, _scatter_index(index_, source_, dim_), scaled).reshape(self.shape)


@register("index_add", "cpp_op", redirect="multicomposite::index_add.entry")
def index_add_cpp_op(self, dim, index, source, *, alpha=1):
    """Along the first dimension with alpha 1: multicomposite::add_rows (self plus the source's rows summed at the
    index), whose source's gradient is multicomposite::gather_rows (rows.cpp, NOTE [rows ops]); anything else
    PyTorch's own index_add (multicomposite::index_add.entry decides in C++)."""
    return CPP_OPS.get().index_add.entry(self, dim, index, source, alpha=alpha)


class IndexAddScatter(Function):
    """self.scatter_add(dim, index, alpha * source) with its own backward, jvp and vmap rules (index: scatter form,
    which is closed under batching: what IndexAdd's vmap rule turns to where the index itself is batched)."""

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
        return apply(IndexAddScatter, self, dim + 1, index, source, alpha), 0


def _batched_scatter_index(index: torch.Tensor, source: torch.Tensor, dim: int) -> torch.Tensor:
    """A batched 1-d index (batch dimension first, physical) in scatter form for ``source`` (batch dimension first;
    ``dim`` counts it)."""
    shape = [1] * source.dim()
    shape[0], shape[dim] = index.shape[0], index.shape[1]
    return index.reshape(shape).expand_as(source)


class IndexAdd(Function):
    """index_add with a 1-d index shared by every sample, with its own backward, jvp and vmap rules.

    Fused: forward is PyTorch's own index_add, run once over the whole batch (the vmap rule moves the batch dimension
    to the front and shifts ``dim``); backward is one index_select. Where vmap batches the index itself, the rule
    turns to IndexAddScatter.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, alpha: Any) -> torch.Tensor:
        return aten.index_add(self, dim, index, source, alpha=alpha)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, ctx.dim, index, _, ctx.alpha = inputs
        ctx.self_shape = self.shape
        ctx.save_for_backward(index)
        ctx.save_for_forward(index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_source = None
        if ctx.needs_input_grad[3]:
            grad_source = grad.index_select(ctx.dim, index)
            grad_source = grad_source if ctx.alpha == 1 else grad_source * ctx.alpha
        return grad, None, None, grad_source, None

    @staticmethod
    def jvp(ctx: Any, self_t, _dim, _index, source_t, _alpha) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        if source_t is None:
            return self_t.clone()
        if self_t is None:
            self_t = source_t.new_zeros(ctx.self_shape)
        return apply(IndexAdd, self_t, ctx.dim, index, source_t, ctx.alpha)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, dim, index, source, alpha):
        if in_dims[2] is not None:
            self, index, source = batch_first(info, (in_dims[0], in_dims[2], in_dims[3]), self, index, source)
            return apply(IndexAddScatter, self, dim + 1, _batched_scatter_index(index, source, dim + 1), source,
                                         alpha), 0
        self, source = batch_first(info, (in_dims[0], in_dims[3]), self, source)
        return apply(IndexAdd, self, dim + 1, index, source, alpha), 0


@register("index_add", "primitive", function=IndexAdd)
def index_add_primitive(self, dim, index, source, *, alpha=1):
    """IndexAdd: one autograd node with its own backward, jvp and vmap rules (fused: one native kernel per batch)."""
    check_index_add(self, dim, index, source, alpha)
    alpha = native_alpha(self, alpha)
    flat, dim_, index_, source_ = rank1_view(self, dim, index, source)
    return apply(IndexAdd, flat, dim_, index_, source_, alpha).reshape(self.shape)


# --- index_copy --------------------------------------------------------------------------------------------------


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
    flat, dim_, index_, source_ = rank1_view(self, dim, index, source)
    try:
        return flat.scatter(dim_, _scatter_index(index_, source_, dim_), source_).reshape(self.shape)
    except RuntimeError as error:  # scatter's own bounds check: native raises IndexError
        index_out_of_bounds("index_copy", dim, flat.shape[dim_], error)


class IndexCopyScatter(Function):
    """self.scatter(dim, index, source) with its own backward, jvp and vmap rules (index: scatter form, closed under
    batching: what IndexCopy's vmap rule turns to where the index itself is batched)."""

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
        return apply(IndexCopyScatter, self, dim + 1, index, source), 0


class IndexCopy(Function):
    """index_copy with a 1-d index shared by every sample, with its own backward, jvp and vmap rules.

    Fused: forward is PyTorch's own index_copy, run once over the whole batch; backward is IndexCopy itself (zeros
    copied in, for self) and one index_select (for source). Where vmap batches the index, the rule turns to
    IndexCopyScatter.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor | None, dim: int, index: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
        return aten.index_copy(self, dim, index, source)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, ctx.dim, index, source = inputs
        ctx.self_shape, ctx.source_shape = self.shape, source.shape
        ctx.save_for_backward(index)
        ctx.save_for_forward(index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_self = grad_source = None
        if ctx.needs_input_grad[0]:
            # Positions that source overwrote get no gradient from self.
            zeros = torch.zeros(ctx.source_shape, dtype=grad.dtype, device=grad.device)
            grad_self = apply(IndexCopy, grad, ctx.dim, index, zeros)
        if ctx.needs_input_grad[3]:
            grad_source = grad.index_select(ctx.dim, index)
        return grad_self, None, None, grad_source

    @staticmethod
    def jvp(ctx: Any, self_t, _dim, _index, source_t) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        like = self_t if self_t is not None else source_t
        self_t = self_t if self_t is not None else torch.zeros(ctx.self_shape, dtype=like.dtype, device=like.device)
        source_t = (source_t if source_t is not None
                    else torch.zeros(ctx.source_shape, dtype=like.dtype, device=like.device))
        return apply(IndexCopy, self_t, ctx.dim, index, source_t)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, dim, index, source):
        if in_dims[2] is not None:
            self, index, source = batch_first(info, (in_dims[0], in_dims[2], in_dims[3]), self, index, source)
            return apply(IndexCopyScatter, self, dim + 1, _batched_scatter_index(index, source, dim + 1), source), 0
        self, source = batch_first(info, (in_dims[0], in_dims[3]), self, source)
        return apply(IndexCopy, self, dim + 1, index, source), 0


@register("index_copy", "primitive", function=IndexCopy)
def index_copy_primitive(self, dim, index, source):
    """IndexCopy: one autograd node with its own backward, jvp and vmap rules (fused: one native kernel per batch)."""
    check_index_copy(self, dim, index, source)
    flat, dim_, index_, source_ = rank1_view(self, dim, index, source)
    return apply(IndexCopy, flat, dim_, index_, source_).reshape(self.shape)


# --- index_fill --------------------------------------------------------------------------------------------------


def index_mask(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
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


@register("index_fill", "mutating")
def index_fill_mutating(self, dim, index, value):
    """Clone self, then index_fill_ in place."""
    check_index_fill(self, dim, index, value)
    return self.clone().index_fill_(dim, index, value)


@register("index_fill", "functional")
def index_fill_functional(self, dim, index, value):
    """where(mask of index along dim, value, self)."""
    check_index_fill(self, dim, index, value)
    return torch.where(index_mask(self, dim, index), scalar_or_tensor(value, self), self)


class IndexFill(Function):
    """index_fill with a 1-d, non-negative index shared by every sample and a tensor value that broadcasts to self
    (one value per sample), with its own backward, jvp and vmap rules. ``None`` for self or value stands for zero.

    Fused: forward is ``fused.index_fill``, one native index_copy of the (expanded) value over the whole batch, which
    touches only the indexed slices besides the copy of self; backward is IndexFill itself (zeros filled in, for
    self) and a sum over the indexed slices (for value). Where vmap batches the index, the rule turns to Fill
    at the index's mask.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        return fused.index_fill(self, dim, index, value)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self, ctx.dim, index, value = inputs
        ctx.self_shape = self.shape
        ctx.value_shape = None if value is None else value.shape
        ctx.save_for_backward(index)
        ctx.save_for_forward(index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_self = grad_value = None
        if ctx.needs_input_grad[0]:
            grad_self = apply(IndexFill, grad, ctx.dim, index, None)
        if ctx.value_shape is not None and ctx.needs_input_grad[3]:
            # At the index's mask, not index_select: repeated indices fill once, and unique() cannot be batched.
            grad_value = apply(Fill, None, index_mask(grad, ctx.dim, index), grad).sum_to_size(ctx.value_shape)
        return grad_self, None, None, grad_value

    @staticmethod
    def jvp(ctx: Any, self_t, _dim, _index, value_t) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        if self_t is None:
            self_t = torch.zeros(ctx.self_shape, dtype=value_t.dtype, device=value_t.device)
        return apply(IndexFill, self_t, ctx.dim, index, value_t)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, dim, index, value):
        rank = self.dim() - (in_dims[0] is not None)
        if in_dims[2] is not None:
            index = index.movedim(in_dims[2], 0)
            size = self.shape[dim + (in_dims[0] is not None and in_dims[0] <= dim)]
            hits = torch.zeros(info.batch_size, size, dtype=torch.bool, device=index.device).scatter(1, index, True)
            mask = hits.reshape((info.batch_size, size) + (1,) * (rank - dim - 1))
            self, mask, value = batch_first(info, (in_dims[0], 0, in_dims[3]), self, mask, value, rank=rank)
            return apply(Fill, self, mask, value), 0
        self, value = batch_first(info, (in_dims[0], in_dims[3]), self, value, rank=rank)
        return apply(IndexFill, self, dim + 1, index, value), 0


@register("index_fill", "primitive", function=IndexFill)
def index_fill_primitive(self, dim, index, value):
    """IndexFill: one autograd node with its own backward, jvp and vmap rules (fused: one native kernel per batch)."""
    check_index_fill(self, dim, index, value)
    index_mask(self, dim, index)  # the bounds check native makes ([-size, size)), which works under vmap too
    flat, dim_, index_, _ = rank1_view(self, dim, index, None)
    size = flat.shape[dim_]
    filled = apply(IndexFill, flat, dim_, index_ % max(size, 1), scalar_or_tensor(value, self)).reshape(self.shape)
    return laid_out_like(filled, self)
