"""Helpers for primitives: ``torch.autograd.Function`` classes whose ``vmap`` rule re-applies the Function itself.

A primitive's vmap rule moves every batch dimension to the front and calls ``apply`` again one level down, so the
Function stays a single node for every transform above it (``grad(vmap(f))``, ``jacfwd``, ``hessian``): autograd never
sees its decomposition.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._functorch import maybe_get_level

# Dimension order of each memory format, as a permutation of the logical dimensions.
_FORMAT_ORDER: dict[torch.memory_format, tuple[int, ...]] = {
    torch.channels_last: (0, 2, 3, 1),
    torch.channels_last_3d: (0, 2, 3, 4, 1),
}


def batch_first(info: Any, in_dims: tuple[int | None, ...], *tensors: Any, rank: int | None = None) -> list[Any]:
    """Each tensor with its batch dimension at 0 and of size ``info.batch_size`` (unbatched ones are expanded).

    With ``rank``, singleton dimensions are inserted after the batch dimension so that every tensor has ``rank``
    logical dimensions, which keeps right-aligned broadcasting between them intact.
    """
    moved = []
    for tensor, dim in zip(tensors, in_dims, strict=True):
        if not isinstance(tensor, torch.Tensor):
            moved.append(tensor)
            continue
        tensor = tensor.expand(info.batch_size, *tensor.shape) if dim is None else tensor.movedim(dim, 0)
        if rank is not None and tensor.dim() - 1 < rank:
            tensor = tensor[(slice(None),) + (None,) * (rank - tensor.dim() + 1)]
        moved.append(tensor)
    return moved


def zeros_if_none(tangent: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if tangent is None else tangent


def laid_out(tensor: torch.Tensor, memory_format: torch.memory_format | None, batch_ndim: int = 0) -> torch.Tensor:
    """A copy of ``tensor`` whose trailing (per-sample) dimensions are laid out in ``memory_format``.

    Built from ``permute`` and ``contiguous`` only, which have batching rules, so it works on a batched tensor and on
    a physical tensor with ``batch_ndim`` leading batch dimensions alike.
    """
    order = _FORMAT_ORDER.get(memory_format) if memory_format is not None else None
    if order is None or tensor.dim() - batch_ndim != len(order):
        if memory_format in (None, torch.preserve_format):
            return tensor.clone()
        return tensor.clone(memory_format=torch.contiguous_format if batch_ndim else memory_format)
    lead = tuple(range(batch_ndim))
    permutation = lead + tuple(batch_ndim + d for d in order)
    inverse = [0] * len(permutation)
    for position, dim in enumerate(permutation):
        inverse[dim] = position
    # clone, not contiguous(): a composite calling a covered op would re-enter the router (it passes through).
    return tensor.permute(permutation).clone(memory_format=torch.contiguous_format).permute(inverse)


def copy_laid_out(tensor: torch.Tensor, memory_format: torch.memory_format | None, batch_ndim: int = 0):
    """Like ``laid_out`` but through ``empty_strided`` and ``copy_``: the result is not a view.

    For a primitive's forward, which runs on plain tensors below every transform, where a view output would confuse
    forward AD ("tangent must have the same layout as primal").
    """
    order = _FORMAT_ORDER.get(memory_format) if memory_format is not None else None
    if order is None or tensor.dim() - batch_ndim != len(order):
        if memory_format in (None, torch.preserve_format) or batch_ndim:
            return tensor.clone()
        return tensor.clone(memory_format=memory_format)
    permutation = tuple(range(batch_ndim)) + tuple(batch_ndim + d for d in order)
    strides = [0] * tensor.dim()
    step = 1
    for dim in reversed(permutation):
        strides[dim] = step
        step *= tensor.shape[dim]
    out = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def is_laid_out(tensor: torch.Tensor, memory_format: torch.memory_format | None) -> bool:
    """Whether ``tensor`` already satisfies ``memory_format``; False where vmap cannot tell (then a copy is made)."""
    if memory_format in (None, torch.preserve_format):
        return True
    # vmap cannot answer is_contiguous for channels_last (NYI), and under torch.compile the failed query cannot even
    # be caught: a functorch-wrapped tensor is treated as not laid out, which costs one copy and no correctness.
    if torch.compiler.is_compiling() or maybe_get_level(tensor) != -1:
        return False
    return tensor.is_contiguous(memory_format=memory_format)
