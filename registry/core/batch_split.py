"""Batch splitting at a vmap level inside ``use()``: where the samples disagree, re-run the level on groups that agree.

A Python branch on a batched tensor (``if mask.all():``, ``bool()``, ``.item()``, ``torch.equal``) or an op whose
output shape depends on the values (boolean-mask indexing, ``nonzero``, ``unique``, ``masked_select``) needs one
answer for the whole batch. Where the samples disagree, the kernel raises ``SamplesDisagreeError`` with each sample's
answer (registry.core.disagree). vmap's implementation (registry.core.functionalization wraps it) catches it at the
level that batches the answer and re-runs that level's function on each group of samples whose answers agree, as a
vmap of its own; the groups' outputs are concatenated and put back in the original order with ``index_select`` of the
inverse permutation, which every outer transform differentiates. A second disagreement inside a group splits that
group again; a group of one sample is the per-sample loop. Where the groups' outputs differ in shape (the per-sample
shapes never agree again by the level's end) no single batched tensor can hold them: the original clear error is
raised.

When every sample agrees nothing is re-run: the first run's result is returned as it is.

Boolean-mask indexing under vmap (``x[mask]``, ``x[mask] = v``) is registry.core.mask_indexing's: it turns a batched
mask into the integer positions of its ``True`` entries, which agree or split as above.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _DisableFuncTorch  # noqa: PLC2701 - functorch's bindings have no public API
from torch.utils._pytree import (  # noqa: PLC2701 - PyTorch's pytree
    _broadcast_to_and_flatten,
    tree_flatten,
    tree_unflatten,
)

from registry.core.disagree import SamplesDisagreeError
from registry.core.frames import calling_user_frame

# What vmap's implementation is called with after the function (``_flat_vmap``'s arguments).
VmapRunner = Callable[..., Any]


class BatchSplitWarning(UserWarning):
    """The samples of a vmapped batch disagreed, and the level ran once per group of agreeing samples."""


class SplitShapeError(RuntimeError):
    """A split level's groups returned outputs of different shapes: no single batched tensor holds them."""


class Splitter:
    """Where a split was said already (once per call site)."""

    def __init__(self) -> None:
        self.warned: set[str] = set()
        self.lock = threading.Lock()

    def warn(self, error: SamplesDisagreeError, batch_size: int, sizes: list[int]) -> None:
        site = error.site or "an unknown line"
        with self.lock:
            if site in self.warned:
                return
            self.warned.add(site)
        frame = calling_user_frame()
        message = (f"vmap: the samples of a batch of {batch_size} disagree at {site}, so the batch was split into "
                   f"{len(sizes)} groups of agreeing samples (sizes {', '.join(map(str, sizes))}), each run as its "
                   f"own vmap (the function runs again from its start per group). To keep one batch: "
                   f"{error.alternative}")
        if frame is not None:
            warnings.warn_explicit(message, BatchSplitWarning, frame.filename, frame.lineno)
        else:
            warnings.warn(message, BatchSplitWarning, stacklevel=2)

    def forget_warnings(self) -> None:
        """Say the next split of every call site again (a test that asserts the warning runs apart from others)."""
        with self.lock:
            self.warned.clear()


SPLITTER = Splitter()

def _groups(keys: torch.Tensor) -> list[list[int]]:
    """Indices of dim 0 of ``keys`` grouped by equal rows, groups in order of first appearance (NaN equals NaN: the
    loop's sample takes the same branch for each)."""
    with _DisableFuncTorch():
        rows = keys.reshape(keys.shape[0], -1).tolist()
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(tuple("nan" if value != value else value for value in row), []).append(index)
    return list(groups.values())


def split_level(run: VmapRunner, error: SamplesDisagreeError, level: int, func: Callable[..., Any], batch_size: int,
                flat_in_dims: list[int | None], flat_args: list[Any], args_spec: Any, out_dims: Any, randomness: str,
                reset_random: Callable[[], None], **kwargs: Any) -> Any:
    """The level's result computed per group of agreeing samples, or NotImplemented where ``error`` is not this
    level's to split (another level batches the disagreement, or every sample of this level agrees with the others).

    ``run``: vmap's implementation inside ``use()`` (each group may split again or need functionalizing);
    ``reset_random``: sets the random state back to where the level started. The first group starts there; under
    ``randomness="same"`` every group does (each draws what the first drew, as the unsplit batch would share one
    draw); under ``"different"`` each group goes on drawing where the previous one stopped.
    """
    if level not in error.levels:
        return NotImplemented
    with _DisableFuncTorch():
        keys = error.keys.movedim(error.levels.index(level), 0)
    if keys.shape[0] != batch_size:
        return NotImplemented
    groups = _groups(keys)
    if len(groups) < 2:
        return NotImplemented
    SPLITTER.warn(error, batch_size, [len(group) for group in groups])
    outputs = []
    for number, group in enumerate(groups):
        if number == 0 or randomness == "same":
            reset_random()
        picked = []
        for arg, dim in zip(flat_args, flat_in_dims, strict=True):
            if dim is None:
                picked.append(arg)
            else:
                picked.append(arg.index_select(dim, torch.tensor(group, device=arg.device)))
        outputs.append(run(func, len(group), flat_in_dims, picked, args_spec, out_dims, randomness, **kwargs))
    return _combine(outputs, groups, out_dims, error)


def _combine(outputs: list[Any], groups: list[list[int]], out_dims: Any, error: SamplesDisagreeError) -> Any:
    """The groups' outputs as one: each batched leaf concatenated along its out_dim, then put back in sample order."""
    flats = [tree_flatten(output) for output in outputs]
    spec = flats[0][1]
    if any(other != spec for _, other in flats[1:]):
        raise SplitShapeError(f"{error} (the batch was split where the samples disagree, and the groups returned "
                              "different structures)")
    dims = _broadcast_to_and_flatten(out_dims, spec)
    if dims is None:
        raise ValueError(f"vmap: out_dims={out_dims} does not match the structure of the function's output")
    order = [index for group in groups for index in group]
    inverse = [0] * len(order)
    for position, index in enumerate(order):
        inverse[index] = position
    leaves = []
    for position, dim in enumerate(dims):
        parts = [flat[position] for flat, _ in flats]
        if dim is None or not isinstance(parts[0], torch.Tensor):
            leaves.append(parts[0])
            continue
        shapes = {tuple(s for i, s in enumerate(p.shape) if i != dim % p.dim()) for p in parts}
        if len(shapes) > 1:
            raise SplitShapeError(
                f"{error} (the batch was split where the samples disagree, but the groups' outputs still differ in "
                f"shape at the end of the vmapped function: {', '.join(str(list(s)) for s in sorted(shapes))} "
                "apart from the batch dimension, so no single batched tensor holds them)")
        joined = torch.cat(parts, dim)
        leaves.append(joined.index_select(dim, torch.tensor(inverse, device=joined.device)))
    return tree_unflatten(leaves, spec)
