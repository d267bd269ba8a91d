"""Composites of the views-and-copies family: the ``*_copy`` ops, ``diagflat``, ``fill``, ``narrow`` with a tensor
start, ``column_stack``, ``unfold``/``unfold_copy``, ``cummax``/``cummin``.

Each is built from view and indexing ops that have batching rules (``permute``, ``index_select``, ``gather``,
``cat``): PyTorch 2.13 lacks a batching rule for the op itself (vmap's per-sample loop, or an error), or for a
derivative op its backward calls (``unfold_backward``, ``cummaxmin_backward``).
"""

from __future__ import annotations

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    _unwrap_batched as unwrap_batched,
)
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    get_unwrapped,
    is_batchedtensor,
    maybe_get_level,
)
from torch._decomp import decompositions  # noqa: PLC2701 - PyTorch's own decompositions

from composites.masked import scalar_or_tensor
from registry.core import rules
from registry.core.context import vmap_levels
from registry.core.ops import overloads
from registry.core.registration import define_op, register, register_derivative

aten = torch.ops.aten


def contiguous_copy(view: torch.Tensor) -> torch.Tensor:
    """A ``*_copy`` op's result: a fresh contiguous tensor holding ``view``'s values."""
    return view.clone(memory_format=torch.contiguous_format)


# --- the *_copy ops: the view, then a contiguous clone (JAX's defvectorized: the view ops batch) ----------------------

def _copy_op(name: str, overload: str, doc: str, only: tuple[str, ...] | None = None) -> None:
    aten_name = f"aten::{name}.{overload}" if overload else f"aten::{name}"
    define_op(name, overload, tensors=("self",), doc=doc, opinfo=(name,), inplace=False,
              overloads=overloads(name, inplace=False, only=only),
              rules={"native": rules.batched_without_batching_rule(aten_name, "self")})


_copy_op("permute_copy", "", "a contiguous copy of self with its dimensions permuted")
_copy_op("squeeze_copy", "dims", "a contiguous copy of self without the size-1 dimensions (all, or those in dim)")
_copy_op("unsqueeze_copy", "", "a contiguous copy of self with a size-1 dimension inserted at dim")
_copy_op("t_copy", "", "a contiguous copy of self transposed (a matrix or fewer dimensions)")
_copy_op("transpose_copy", "int", "a contiguous copy of self with dimensions dim0 and dim1 swapped")


@register("permute_copy", "functional")
def permute_copy_functional(self, dims):
    """permute (a view with a batching rule), then a contiguous clone."""
    return contiguous_copy(self.permute(dims))


@register("squeeze_copy", "functional")
def squeeze_copy_functional(self, dim=None):
    """squeeze (a view with a batching rule), then a contiguous clone; serves all three overloads."""
    return contiguous_copy(self.squeeze() if dim is None else self.squeeze(dim))


@register("unsqueeze_copy", "functional")
def unsqueeze_copy_functional(self, dim):
    """unsqueeze (a view with a batching rule), then a contiguous clone."""
    return contiguous_copy(self.unsqueeze(dim))


@register("t_copy", "functional")
def t_copy_functional(self):
    """t (a view with a batching rule), then a contiguous clone."""
    return contiguous_copy(self.t())


@register("transpose_copy", "functional")
def transpose_copy_functional(self, dim0, dim1):
    """transpose (a view with a batching rule), then a contiguous clone."""
    return contiguous_copy(self.transpose(dim0, dim1))


# --- diagflat ------------------------------------------------------------------------------------------------------

define_op("diagflat", "", tensors=("self",), doc="a matrix with self's elements, flattened, on its offset diagonal",
          opinfo=("diagflat",), inplace=False,
          rules={"native": rules.batched_without_batching_rule("aten::diagflat", "self")})


@register("diagflat", "functional")
def diagflat_functional(self, offset=0):
    """diag_embed of self flattened: diag_embed batches (diagflat itself has no batching rule)."""
    return torch.diag_embed(self.reshape(-1), offset)


# --- fill (the functional overloads only: fill_ is every factory's building block) ---------------------------------


define_op("fill", "Scalar", tensors=("self", "value"), doc="a tensor of self's shape and dtype filled with value",
          opinfo=("fill",), inplace=False,
          rules={"native": rules.first_of(
              rules.batched_without_batching_rule("aten::fill", "self", "value"),
              rules.forward_ad_without_batching_rule("aten::fill.Scalar (fill(self_t, 0))", status="error"))})


@register("fill", "functional")
def fill_functional(self, value):
    """value, cast to self's dtype, expanded to self's shape and copied: expand and clone batch."""
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor with {value.dim()} "
                           "dimensions.")
    return contiguous_copy(scalar_or_tensor(value, self).expand(self.shape))


# --- narrow with a tensor start (narrow.Tensor only: narrow.default is everywhere and has a batching rule) ---------

define_op("narrow", "Tensor", tensors=("self", "start"), doc="self's length elements along dim from start on",
          opinfo=("narrow",), overloads=overloads("narrow", only=("narrow.Tensor",)),
          rules={"native": rules.fails_when(
              rules.innermost_vmap, "error",
              "aten::narrow.Tensor has no batching rule and vmap cannot fall back on a view op (under autograd it "
              "decomposes into narrow.default first)")})


@register("narrow", "functional")
def narrow_functional(self, dim, start, length):
    """narrow.default at start's value where start is the same for every sample (a view, as native); index_select of
    start + arange(length) where start is batched (a copy: a view cannot start at a different place per sample)."""
    if not vmap_levels(start):
        return aten.narrow.default(self, dim, int(start), length)
    size = self.shape[dim]
    first = torch.where(start < 0, start + size, start)
    return self.index_select(dim, first + torch.arange(length, device=self.device))


# --- column_stack --------------------------------------------------------------------------------------------------

define_op("column_stack", "", tensors=("tensors",), doc="tensors side by side as columns (0-d and 1-d as columns)",
          opinfo=("column_stack",),
          rules={"native": rules.fails_when(
              rules.innermost_vmap, "error",
              "aten::column_stack has no batching rule and vmap cannot fall back on it (under autograd it "
              "decomposes into hstack first)")})


@register("column_stack", "functional")
def column_stack_functional(tensors):
    """Each 0-d or 1-d tensor reshaped to one column, then hstack (cat batches)."""
    return torch.hstack([t.reshape(t.numel(), 1) if t.dim() <= 1 else t for t in tensors])


# --- unfold, unfold_copy -------------------------------------------------------------------------------------------


def window_index(length: int, size: int, step: int, dim: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The flat positions along a dimension of ``length`` that unfold's windows take, and the number of windows."""
    if size > length:
        raise RuntimeError(f"maximum size for tensor at dimension {dim} is {length} but size is {size}")
    if step <= 0:
        raise RuntimeError(f"step is {step} but must be > 0")
    windows = (length - size) // step + 1
    starts = torch.arange(windows, device=device) * step
    return (starts[:, None] + torch.arange(size, device=device)).reshape(-1), windows


def unfold_by_index(self: torch.Tensor, dimension: int, size: int, step: int) -> torch.Tensor:
    """unfold as a copy: index_select of every window's positions (its backward is index_add, which batches)."""
    if self.dim() == 0:  # one window of a 0-d tensor: shape (size,)
        return unfold_by_index(self.reshape(1), 0, size, step).reshape(size)
    dim = dimension % self.dim()
    index, windows = window_index(self.shape[dim], size, step, dim, self.device)
    picked = self.index_select(dim, index).unflatten(dim, (windows, size))
    return picked.movedim(dim + 1, -1)


# Inside use() native unfold and unfold_copy are fast everywhere: their backward, unfold_backward, has no batching
# rule in PyTorch (outside use(), vmap(grad) and jacrev loop over it), and the derivative kernel below batches it. So
# native keeps no rule here, and unfold stays a view. The functional composites (copies) are there for a pin.
define_op("unfold", "", tensors=("self",), doc="self's windows of size elements every step along dimension (a view)",
          opinfo=("unfold",), inplace=False)
define_op("unfold_copy", "", tensors=("self",), doc="a copy of self's windows of size elements every step along "
          "dimension", opinfo=("unfold_copy",), inplace=False)


@register("unfold", "functional")
def unfold_functional(self, dimension, size, step):
    """index_select of every window's positions, unflattened (a copy, not a view; backward index_add batches)."""
    return unfold_by_index(self, dimension, size, step)


@register("unfold_copy", "functional")
def unfold_copy_functional(self, dimension, size, step):
    """index_select of every window's positions, unflattened (backward index_add batches)."""
    return unfold_by_index(self, dimension, size, step)


@register_derivative("unfold", "unfold_backward")
def unfold_backward_functional(grad_in, input_sizes, dim, size, step):
    """index_add of every window's gradient at the positions it took (index_add batches)."""
    sizes = tuple(input_sizes) or (1,)
    dim = dim % len(sizes)
    index, windows = window_index(sizes[dim], size, step, dim, grad_in.device)
    windows_last = grad_in.reshape(*sizes[:dim], windows, *sizes[dim + 1:], size)
    source = windows_last.movedim(-1, dim + 1).flatten(dim, dim + 1)
    return grad_in.new_zeros(sizes).index_add(dim, index, source).reshape(tuple(input_sizes))


# --- cummax, cummin ------------------------------------------------------------------------------------------------

# Outside use(), jacrev loops over cummax's and cummin's backward, cummaxmin_backward, which has no batching rule
# (vmap(grad) measured without the loop); inside use() the derivative kernel below batches it, so native keeps no rule.
define_op("cummax", "", tensors=("self",), doc="the running maximum of self along dim, and where it was taken",
          opinfo=("cummax",))
define_op("cummin", "", tensors=("self",), doc="the running minimum of self along dim, and where it was taken",
          opinfo=("cummin",))


@register("cummax", "functional")
def cummax_functional(self, dim):
    """cummax's indices, then gather of self at them: the values' backward is scatter_add, which batches."""
    _, indices = aten.cummax(self, dim)
    return self.gather(dim, indices), indices


@register("cummin", "functional")
def cummin_functional(self, dim):
    """cummin's indices, then gather of self at them: the values' backward is scatter_add, which batches."""
    _, indices = aten.cummin(self, dim)
    return self.gather(dim, indices), indices


@register_derivative("cummax", "cummaxmin_backward")
def cummaxmin_backward_functional(grad, input, indices, dim):
    """grad added at the indices the running extreme came from: scatter_add batches."""
    if input.numel() == 0:
        return input
    return torch.zeros_like(input).scatter_add(dim, indices, grad)


# --- tensor_split with a tensor of indices or sections (only that overload: the others have batching rules) --------


def same_in_every_sample(tensor: torch.Tensor, op: str, argument: str) -> torch.Tensor:
    """``tensor``'s values as a plain tensor, where every sample of every vmap holds the same ones (an argument that
    decides output shapes, which vmap needs equal across the batch). Peels the functorch wrappers down to the physical
    tensor, then checks and drops the batch dimensions innermost level first."""
    batch_dims: list[int | None] = []
    while (level := maybe_get_level(tensor)) != -1:
        if is_batchedtensor(tensor):
            tensor, bdim = unwrap_batched(tensor, level)
            batch_dims.append(bdim)
        else:
            tensor = get_unwrapped(tensor)
    for bdim in reversed(batch_dims):
        first = tensor.narrow(bdim, 0, 1)
        if not torch.equal(tensor, first.expand_as(tensor)):
            raise RuntimeError(
                f"{op}: {argument} differs across the vmapped batch, so each sample's outputs would have other "
                "shapes: vmap does not support batching operators that can output dynamic shape. Pass the same "
                f"{argument} to every sample (unbatched), or pad the outputs to one shape yourself.")
        tensor = first.squeeze(bdim)
    return tensor


define_op("tensor_split", "tensor_indices_or_sections", tensors=("self", "tensor_indices_or_sections"),
          doc="self split along dim at the indices (1-d) or into the number of sections (0-d) that a tensor holds",
          opinfo=("tensor_split",),
          overloads=overloads("tensor_split", only=("tensor_split.tensor_indices_or_sections",)),
          rules={"native": rules.fails_when(
              lambda ctx: any(transform in ctx.stack for transform in ("vmap", "grad", "jvp")), "error",
              "aten::tensor_split.tensor_indices_or_sections reads the tensor's data in C++: it raises under every "
              "functorch transform (no batching rule under vmap; no storage under grad and jvp)")})


@register("tensor_split", "functional")
def tensor_split_functional(self, tensor_indices_or_sections, dim=0):
    """The tensor's values read in Python (the same for every sample), then tensor_split with a list or an int."""
    split = tensor_indices_or_sections
    if split.is_floating_point() or split.is_complex() or split.dtype == torch.bool:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to have integer dtype, but got "
                           f"{split.dtype}")
    if split.dim() > 1:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
                           f"one-dimensional tensor, but got a tensor with {split.dim()} dims")
    values = same_in_every_sample(split, "tensor_split", "tensor_indices_or_sections")
    if values.dim() == 0:
        return aten.tensor_split.sections(self, int(values), dim)
    return aten.tensor_split.indices(self, values.tolist(), dim)


# --- _chunk_cat ----------------------------------------------------------------------------------------------------

define_op("_chunk_cat", "", tensors=("tensors",),
          doc="each tensor cut into num_chunks chunks along dim (zero-padded), flattened after dim, concatenated",
          opinfo=("_chunk_cat",),
          rules={"native": rules.no_batching_rule("aten::_chunk_cat", status="error",
                                                  detail="vmap raises (no fallback for it)")})


@register("_chunk_cat", "functional")
def _chunk_cat_functional(tensors, dim, num_chunks):
    """PyTorch's own decomposition (torch._decomp): constant_pad_nd, reshape and cat, which batch."""
    return decompositions._chunk_cat(tensors, dim, num_chunks)


# --- roll ----------------------------------------------------------------------------------------------------------

# Measured on torch 2.13: with dims empty roll flattens self; its batching rule flattens the batch dimension with a 0-d
# sample, so vmap rolls values across the samples (the survey's roll sample 16: a 0-d input, shifts (10,)) and returns
# wrong values, silently. The composite flattens each sample itself.
define_op("roll", "", tensors=("self",), doc="self's elements shifted by shifts along dims (the flattened self where "
          "dims is empty)", opinfo=("roll",), inplace=False,
          rules={"native": rules.fails_when(
              lambda ctx: rules.under_vmap(ctx) and ("self" in ctx.batched or "compile" in ctx.stack
                                                     or ctx.stack.count("vmap") > 1),
              "mismatch", "aten::roll's batching rule, with dims empty, rolls a 0-d sample across the batch: wrong "
              "values")})


@register("roll", "functional")
def roll_functional(self, shifts, dims=()):
    """With dims empty, the roll of each sample flattened, viewed back (what the kernel does outside vmap); else
    PyTorch's roll, whose batching rule is right where dims are given."""
    if len(dims) == 0 and len(shifts) == 1:
        return self.reshape(self.numel()).roll(shifts, 0).view(self.shape)  # numel, not -1: self may be empty
    return aten.roll.default(self, shifts, dims)
