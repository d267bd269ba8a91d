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

Boolean-mask indexing (``x[mask]``, ``edge_index[:, mask]``) under vmap is refused by PyTorch's batching rule for
``aten::index.Tensor``. A kernel there would add a Python call to every tensor index under every transform, so it is
registered only when that refusal is first seen inside ``use()``: it turns a batched boolean index into the integer
indices of its ``True`` entries (``nonzero``, per sample, which agrees or splits as above) and indexes with them.
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

from registry.core import dynamic, mask_writes
from registry.core.context import vmap_levels
from registry.core.disagree import SamplesDisagreeError
from registry.core.frames import calling_user_frame

DISPATCH_KEY = "FuncTorchDynamicLayerFrontMode"

# What vmap's implementation is called with after the function (``_flat_vmap``'s arguments).
VmapRunner = Callable[..., Any]


class BatchSplitWarning(UserWarning):
    """The samples of a vmapped batch disagreed, and the level ran once per group of agreeing samples."""


class SplitShapeError(RuntimeError):
    """A split level's groups returned outputs of different shapes: no single batched tensor holds them."""


class Splitter:
    """Where a split was said already (once per call site), and the boolean-index kernel once it is needed."""

    def __init__(self) -> None:
        self.warned: set[str] = set()
        self.lock = threading.Lock()
        self.libraries: list[torch.library.Library] = []  # kept alive: dropping one unregisters its kernel
        self.routing_on: Callable[[], bool] | None = None
        self.setitem: Callable[..., None] | None = None  # PyTorch's Tensor.__setitem__ while the write patch is in

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

    def mask_indexing_installed(self) -> bool:
        return bool(self.libraries)

    def install_mask_indexing(self, routing_on: Callable[[], bool]) -> None:
        """Register the boolean-index kernel on ``aten::index.Tensor`` and patch ``Tensor.__setitem__`` for writes
        through a mask (once, until ``uninstall``)."""
        with self.lock:
            if self.libraries:
                return
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Warning only once for all operators")
                native = torch.library.get_kernel("aten::index.Tensor", DISPATCH_KEY)
                library.impl("index.Tensor", _make_mask_index(native, routing_on), DISPATCH_KEY, with_keyset=True)
            self.libraries.append(library)
            # Writes through the mask (x[mask] = v): torch.where where v has no per-element dimension, else the
            # mask's positions per sample (registry.core.mask_writes).
            self.setitem = torch.Tensor.__setitem__
            torch.Tensor.__setitem__ = mask_writes.make_setitem(self.setitem, routing_on)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        """Remove the boolean-index kernel and restore ``Tensor.__setitem__`` (installed again when needed)."""
        with self.lock:
            for library in self.libraries:
                library._destroy()
            self.libraries.clear()
            if self.setitem is not None:
                torch.Tensor.__setitem__ = self.setitem  # type: ignore[method-assign]
                self.setitem = None


SPLITTER = Splitter()

_MASK_INDEX = dynamic.DynamicShape(
    "index.Tensor", ("indices",),
    "keep the shape fixed: torch.where(mask, x, fill) or x.masked_fill(~mask, fill) to read, (x * mask).sum() for a "
    "masked sum, or torch.nonzero_static(mask, size=N) to gather a fixed number N of elements", "boolean-mask indexing")


def _read_refusal(site: str) -> str:
    return (f"vmap: boolean-mask indexing{f' at {site}' if site else ''} returns a shape that depends on the values of "
            "a batched mask, so it cannot be batched (each sample would select a different number of elements). Keep "
            f"the shape fixed: {_MASK_INDEX.alternative.removeprefix('keep the shape fixed: ')}")


def _make_mask_index(native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed

    def kernel(keyset: Any, self: torch.Tensor, indices: list[torch.Tensor | None]) -> Any:
        if not routing_on() or not any(index is not None and index.dtype in (torch.bool, torch.uint8)
                                       and vmap_levels(index) for index in indices):
            return call_native(keyset, self, indices)
        return torch.ops.aten.index.Tensor(self, mask_writes.positions_form(indices, _MASK_INDEX, _read_refusal))

    kernel.__name__ = "multicomposite_mask_index"
    return kernel


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
