"""Composites of the view-scatter family: ``select_scatter``, ``slice_scatter``, ``diagonal_scatter``,
``as_strided_scatter`` (self, with src written into one of its views).

They are what functionalization makes of a write through a view (``buf[i] = v``, ``out[:, 1:] = v``,
``out.diagonal().copy_(v)``, ``out.as_strided(...).copy_(v)``), and what autograd's backward of such a write makes
(``as_strided_scatter``). PyTorch 2.13 has no batching rule for ``as_strided_scatter`` ("requires special
handling"), and ``slice_scatter``'s batching rule fails on the open end functionalization records for ``out[:, 1:]``
(end = 2**63 - 1: "IntArrayRef contains an int that cannot be represented as a SymInt") and on a step with one.

The functional composites write at index tensors: the positions the view covers are read off a plain tensor of
self's flat positions (``arange(numel).view(shape).select(dim, index)``), which no transform wraps, and src is
scattered there with ``scatter``, whose batching rule and derivatives (scatter, gather) cover every stack.
``slice_scatter``'s composite clamps start and end to self's size first, as ``slice`` does, and then calls PyTorch's
own kernel, whose batching rule works for those.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from registry.core import rules
from registry.core.ops import overloads
from registry.core.registration import define_op, register

aten = torch.ops.aten

_SLICE_EVIDENCE = ("aten::slice_scatter's batching rule fails on an open end (end = 2**63 - 1, what functionalization "
                   "records for out[:, 1:]: 'IntArrayRef contains an int that cannot be represented as a SymInt') and "
                   "on a step with one ('invalid size, possible overflow?'), under vmap and its derivatives")

define_op("select_scatter", "", tensors=("self", "src"), doc="self with src written into self.select(dim, index)",
          opinfo=("select_scatter",), overloads=overloads("select_scatter", inplace=False))
define_op("slice_scatter", "", tensors=("self", "src"),
          doc="self with src written into self[start:end:step] along dim", opinfo=("slice_scatter",),
          overloads=overloads("slice_scatter", inplace=False),
          rules={"native": rules.fails_when(rules.under_vmap, "error", _SLICE_EVIDENCE)})
define_op("diagonal_scatter", "", tensors=("self", "src"),
          doc="self with src written into self.diagonal(offset, dim1, dim2)", opinfo=("diagonal_scatter",),
          overloads=overloads("diagonal_scatter", inplace=False))
# Its gradient for self is wrong in eager autograd too (it keeps the gradient where src was written and drops it
# elsewhere): the Autograd key gets a kernel as well, so that inside use() eager autograd is right.
define_op("as_strided_scatter", "", tensors=("self", "src"),
          doc="self with src written into self.as_strided(size, stride, storage_offset)",
          opinfo=("as_strided_scatter",), overloads=overloads("as_strided_scatter", inplace=False),
          eager_autograd=("as_strided_scatter",),
          rules={"native": rules.first_of(
              rules.batched_without_batching_rule(
                  "aten::as_strided_scatter", "self", "src", status="error",
                  detail="vmap raises ('requires special handling, and does not yet have a batching rule')"),
              rules.forward_ad_without_batching_rule("aten::as_strided_scatter (its own jvp)", status="error"),
              rules.fails_when(lambda ctx: "grad" in ctx.stack or "autograd" in ctx.stack, "mismatch",
                               "aten::as_strided_scatter's backward for self is inverted in PyTorch 2.13: the "
                               "gradient lands where src was written (measured: x of 4 elements, src written at 0 "
                               "and 1, x's gradient [1, 1, 0, 0]; its jvp is right)"))})


def _positions(self: torch.Tensor) -> torch.Tensor:
    """Self's flat (row-major) positions in self's shape: a plain tensor, the same in every sample."""
    return torch.arange(self.numel(), device=self.device).view(self.shape)


def _sizes(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(size) for size in shape) + "]"


def _check_src(src: torch.Tensor, view_shape: Sequence[int]) -> None:
    if tuple(src.shape) != tuple(view_shape):
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size = {_sizes(src.shape)}, "
                           f"slice size = {_sizes(view_shape)}")


def scatter_at(self: torch.Tensor, positions: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``self`` with ``src`` written at ``positions`` (self's flat positions, a plain long tensor of src's shape), as
    a new contiguous tensor: one scatter over self flattened (src cast to self's dtype, as copy_ casts)."""
    _check_src(src, positions.shape)
    flat = self.reshape(-1)
    written = flat.scatter(0, positions.reshape(-1), src.reshape(-1).to(self.dtype))
    return written.reshape(self.shape)


@register("select_scatter", "functional")
def select_scatter_functional(self, src, dim, index):
    """scatter of src at the positions self.select(dim, index) covers."""
    return scatter_at(self, _positions(self).select(dim, index), src)


def _clamped(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    """start and end as ``slice`` reads them: None as the ends, negatives from the back, both clamped to [0, size]
    and end at least start."""
    first = 0 if start is None else start
    last = size if end is None else end
    first = first + size if first < 0 else first
    last = last + size if last < 0 else last
    first = min(max(first, 0), size)
    last = min(max(last, first), size)
    return first, last


@register("slice_scatter", "functional")
def slice_scatter_functional(self, src, dim=0, start=None, end=None, step=1):
    """PyTorch's own slice_scatter with start and end clamped to self's size (its batching rule works for those)."""
    if self.dim() == 0:
        raise IndexError("slice() cannot be applied to a 0-dim tensor.")
    rank = self.dim()
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    first, last = _clamped(self.shape[dim], start, end)
    return aten.slice_scatter.default(self, src, dim, first, last, step)


@register("diagonal_scatter", "functional")
def diagonal_scatter_functional(self, src, offset=0, dim1=0, dim2=1):
    """scatter of src at the positions self.diagonal(offset, dim1, dim2) covers."""
    return scatter_at(self, _positions(self).diagonal(offset, dim1, dim2), src)


def _layout(self: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """The strides and storage offset the output's storage has, as native's clone_preserve_strides makes it: self's
    own, or contiguous ones from 0 where self overlaps itself (an expanded tensor)."""
    strides = tuple(self.stride())
    if any(stride == 0 and size > 1 for stride, size in zip(strides, self.shape, strict=True)):
        return torch.empty(self.shape, device="meta").stride(), 0
    return strides, self.storage_offset()


def _storage_positions(shape: Sequence[int], strides: Sequence[int], offset: int,
                       device: torch.device) -> torch.Tensor:
    """The storage position of each element of a strided view: offset + sum of index * stride, in ``shape``."""
    positions = torch.full((), offset, dtype=torch.int64, device=device)
    for size, stride in zip(shape, strides, strict=True):
        positions = positions.unsqueeze(-1) + torch.arange(size, device=device) * stride
    return positions


def _is_contiguous_geometry(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a strided view of ``size`` and ``stride`` covers one contiguous block in row-major order (the strides
    of size-1 dimensions do not matter)."""
    expected = 1
    for length, step in zip(reversed(size), reversed(stride), strict=True):
        if length != 1 and step != expected:
            return False
        expected *= length
    return True


@register("as_strided_scatter", "functional")
def as_strided_scatter_functional(self, src, size, stride, storage_offset=None):
    """scatter of src at the elements of self that the strided view's storage positions land on (self's own strides
    and storage offset, as native reads them; views of what lies outside self write nothing that self shows)."""
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride):
        raise RuntimeError(f"mismatch in length of strides and shape: size {_sizes(size)}, stride {_sizes(stride)}")
    _check_src(src, size)
    strides, base = _layout(self)
    offset = base if storage_offset is None else storage_offset
    contiguous = strides == torch.empty(self.shape, device="meta").stride()
    numel = self.numel()
    count = torch.Size(size).numel()
    if (contiguous and _is_contiguous_geometry(size, stride) and 0 <= offset - base
            and offset - base + count <= numel):
        # One block of self's flat elements (the backward of a write into a row, what autograd asks for most):
        # slice_scatter, which batches, and costs half the scatter.
        start = offset - base
        written = aten.slice_scatter.default(self.reshape(-1), src.reshape(-1).to(self.dtype), 0, start,
                                             start + count)
        return written.reshape(self.shape)
    wanted = _storage_positions(size, stride, offset, self.device).reshape(-1)
    if contiguous:
        target = wanted - base
        inside = (target >= 0) & (target < numel)
    else:
        held = _storage_positions(self.shape, strides, base, self.device).reshape(-1)
        order = held.argsort()
        ordered = held[order]
        found = torch.searchsorted(ordered, wanted).clamp(max=max(numel - 1, 0))
        inside = ordered[found] == wanted if numel else torch.zeros_like(wanted, dtype=torch.bool)
        target = order[found] if numel else wanted
    flat_src = src.reshape(-1)
    if not bool(inside.all()):  # a plain tensor: the view's geometry, the same in every sample
        keep = inside.nonzero().reshape(-1)
        target, flat_src = target[keep], flat_src.index_select(0, keep)
    return scatter_at(self.reshape(-1), target, flat_src).reshape(self.shape)
