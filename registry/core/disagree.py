"""The samples of a batched tensor, level by level, and the error that says they disagree.

A Python branch (``bool()``, ``.item()``, ``torch.equal``) or a shape that depends on the values (``nonzero``,
boolean-mask indexing) needs one answer for every sample of a vmapped batch. Where the samples disagree, the kernel
raises ``SamplesDisagreeError``: its message is the clear error (the user's line, the batched form), and it carries each
sample's answer by vmap level, so that the level's vmap (registry.core.batch_split) can re-run the function on the
groups of samples that agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._C import _DisableFuncTorch  # noqa: PLC2701 - functorch's bindings have no public API
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    _add_batch_dim,
    get_unwrapped,
    is_batchedtensor,
    maybe_get_bdim,
    maybe_get_level,
)


class SamplesDisagreeError(RuntimeError):
    """The samples of a vmapped batch disagree on one Python value or on a shape.

    ``levels``: the vmap levels that batch the value, outermost first; ``keys``: a plain tensor whose first
    ``len(levels)`` dimensions are those levels' samples (in that order), the rest each sample's answer; ``site``:
    the user's line (``file:line (`source`)``, or ""); ``alternative``: the batched form that needs no split.
    """

    def __init__(self, message: str, levels: tuple[int, ...], keys: torch.Tensor, site: str, alternative: str):
        super().__init__(message)
        self.levels = levels
        self.keys = keys
        self.site = site
        self.alternative = alternative


@dataclass(frozen=True)
class LevelValues:
    """A batched tensor's samples: ``values`` is plain, its first dimensions the vmap ``levels`` (outermost first)."""

    levels: tuple[int, ...]
    values: torch.Tensor

    @property
    def batch_shape(self) -> torch.Size:
        return self.values.shape[:len(self.levels)]

    def flat(self) -> torch.Tensor:
        """The samples with every level flattened into dim 0 (the innermost level's samples vary fastest)."""
        with _DisableFuncTorch():
            return self.values.reshape(-1, *self.values.shape[len(self.levels):])


def level_values(tensor: torch.Tensor) -> LevelValues | None:
    """``tensor``'s samples at every vmap level that batches it; None if none does or a wrapper cannot be peeled.

    Only the wrappers are read (``get_unwrapped``, ``maybe_get_bdim``): no op runs on a wrapped tensor, so no
    transform records anything. Each batched level inserts its batch dimension into the tensor below it; the positions
    of the dimensions found so far shift past it.
    """
    batch_dims: list[int] = []  # where the batch dimensions found so far are, in the tensor being unwrapped
    levels: list[int] = []
    value = tensor
    while (level := maybe_get_level(value)) != -1:
        if is_batchedtensor(value):
            bdim = maybe_get_bdim(value)
            batch_dims = [dim + 1 if dim >= bdim else dim for dim in batch_dims]
            batch_dims.append(bdim)
            levels.append(level)
        try:
            value = get_unwrapped(value)
        except RuntimeError:
            return None
    if not batch_dims:
        return None
    with _DisableFuncTorch():
        sample_dims = [dim for dim in range(value.dim()) if dim not in batch_dims]
        return LevelValues(tuple(reversed(levels)), value.permute(*reversed(batch_dims), *sample_dims))


def aligned(parts: list[LevelValues | None], tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """The union of the levels of ``parts`` (outermost first) and each tensor's values with those levels first
    (size 1 at a level that does not batch it; a tensor no level batches is its plain self)."""
    levels = tuple(sorted({level for part in parts if part is not None for level in part.levels}))
    out = []
    with _DisableFuncTorch():
        for part, tensor in zip(parts, tensors, strict=True):
            if part is None:
                out.append(tensor.reshape(*([1] * len(levels)), *tensor.shape))
                continue
            values = part.values
            for position, level in enumerate(levels):
                if level not in part.levels:
                    values = values.unsqueeze(position)
            out.append(values)
    return levels, out


def wrap(values: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """A plain tensor whose first dimensions are ``levels``' samples (outermost first), batched at those levels."""
    for level in levels:
        values = _add_batch_dim(values, 0, level)
    return values
