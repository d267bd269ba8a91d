"""Writes through a batched boolean mask inside ``use()``: ``x[mask] = v`` and ``x[mask] += v`` under vmap.

Python's ``x[mask] = v`` is ``aten::index_put_`` with a boolean index, and vmap's batching rule refuses every batched
boolean index ("Attempting to batch over indexing with a boolean mask"), even where the write has a fixed shape. Two
cases, both as a per-sample loop computes them:

- ``v`` broadcasts over the selected elements without a dimension of its own for them (a number, ``x[x < 0] = 0``,
  ``scores[pad] = -inf``, a row broadcast over the selected rows): the write is ``torch.where(mask, v, x)`` (with
  ``accumulate``, ``x + torch.where(mask, v, 0)``), whose shape never depends on the mask. No sample is looped.
- ``v`` holds one entry per selected element (``out[m] = x[m] ** 2``): the mask becomes the integer positions of its
  ``True`` entries per sample (``nonzero``), which agree across the batch or split it (registry.core.batch_split),
  and the write is ``index_put`` at those positions, which vmap batches.

``Tensor.__setitem__`` takes them (see ``make_setitem`` for why there), installed with the boolean-index read
kernel when vmap's refusal is first seen inside ``use()``: until then no assignment pays for the check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from registry.core import dynamic
from registry.core.context import vmap_levels
from registry.core.disagree import level_values
from registry.core.frames import calling_user_frame

MASK_WRITE = dynamic.DynamicShape(
    "index_put", ("indices",),
    "keep the shape fixed: torch.where(mask, v, x) or x.masked_fill(mask, v) to write a value, x.masked_scatter(mask, "
    "v) to write one value per selected element", "a write through a boolean mask")


def _is_batched_mask(index: torch.Tensor | None) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8) and bool(vmap_levels(index))


def where_form(self: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor,
               accumulate: bool) -> torch.Tensor | None:
    """The write as ``torch.where`` over the mask, where ``values`` has no dimension for the selected elements (or
    one of size 1) and the mask is the only index (slices before and after it, ``x[:, mask] = v``); None otherwise.

    The mask of ``k`` dimensions stands at dimension ``p`` of ``self`` (one per ``None`` before it); indexing gives
    ``self.shape[:p] + (selected,) + self.shape[p + k:]``, which ``values`` broadcasts to from the right."""
    masks = [position for position, index in enumerate(indices) if index is not None]
    if len(masks) != 1 or values.dtype != self.dtype:
        return None
    start = masks[0]
    mask = indices[start]
    if mask is None:
        return None
    if mask.dtype == torch.uint8:
        mask = mask.bool()
    trailing = self.dim() - start - mask.dim()  # the dimensions of self after the mask's
    if trailing < 0:
        return None
    if values.dim() > trailing:
        if values.shape[values.dim() - trailing - 1] != 1:
            return None  # one value per selected element: the positions form
        # The selected elements' dimension of size 1 becomes the mask's k dimensions, each of size 1.
        values = values.reshape(*values.shape[:values.dim() - trailing - 1], *([1] * mask.dim()),
                                *values.shape[values.dim() - trailing:])
    selected = mask.reshape(*mask.shape, *([1] * trailing))
    if torch.broadcast_shapes(self.shape, selected.shape, values.shape) != self.shape:
        return None  # a values tensor larger than self: index_put's own error says so
    if accumulate:
        return self + torch.where(selected, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.where(selected, values, self)


def _write_refusal(site: str) -> str:
    return (f"vmap: a write through a boolean mask{f' at {site}' if site else ''} with one value per selected element "
            "has a shape that depends on the values of a batched mask (each sample selects a different number of "
            f"elements). Keep the shape fixed: {MASK_WRITE.alternative.removeprefix('keep the shape fixed: ')}")


def positions_form(indices: list[torch.Tensor | None], spec: dynamic.DynamicShape = MASK_WRITE,
                   refusal: Callable[[str], str] = _write_refusal) -> list[torch.Tensor | None]:
    """``indices`` with each batched boolean mask replaced by the integer positions of its ``True`` entries, per
    sample (a ``k``-dimensional mask stands for ``k`` adjacent integer indices); where the samples' counts differ,
    ``SamplesDisagreeError`` (its message ``refusal(the user's line)``, keyed as ``spec``) splits the batch. The
    boolean-index read kernel (registry.core.batch_split) turns its masks into positions the same way."""
    frame = calling_user_frame()
    site = frame.describe() if frame is not None else ""
    text = refusal(site)
    expanded: list[torch.Tensor | None] = []
    for index in indices:
        found = level_values(index) if _is_batched_mask(index) else None
        if found is None:
            expanded.append(index)
            continue
        positions = dynamic.per_sample(spec, found, lambda mask: torch.nonzero(mask), site, text)
        expanded.extend(positions.unbind(-1))
    return expanded


def _indices(key: Any) -> list[torch.Tensor | None] | None:
    """``x[key]``'s indices where ``key`` is a boolean tensor or a tuple of full slices (``:``) and one boolean tensor
    (``x[:, mask]``), with ``None`` for each slice; None for any other key (PyTorch's own ``__setitem__`` takes it)."""
    parts = key if isinstance(key, tuple) else (key,)
    indices: list[torch.Tensor | None] = []
    for part in parts:
        if isinstance(part, slice) and part == slice(None):
            indices.append(None)
        elif isinstance(part, torch.Tensor) and part.dtype == torch.bool:  # uint8: PyTorch refuses it in a write
            indices.append(part)
        else:
            return None
    return indices if sum(index is not None for index in indices) == 1 else None


def make_setitem(original: Callable[..., None], routing_on: Callable[[], bool]) -> Callable[..., None]:
    """``Tensor.__setitem__``: PyTorch's own unless ``x[mask] = v`` writes through a batched boolean mask inside
    ``use()``.

    NOTE: a kernel at the functorch front key of ``index_put_`` would take every spelling of the write, but that key
    is where the routing kernels of ``index_put_`` and ``index_put`` sit (either backend, re-registered when the
    backend switches), and a second kernel there replaces theirs. ``__setitem__`` is what model code writes; an explicit
    ``index_put_`` with a batched mask is still refused, as ``BooleanMaskError``."""

    def setitem(self: torch.Tensor, key: Any, value: Any) -> None:
        indices = _indices(key) if routing_on() else None
        if indices is None or not any(_is_batched_mask(index) for index in indices):
            return original(self, key, value)
        values = torch.as_tensor(value, device=self.device).to(self.dtype)
        written = where_form(self, indices, values, False)
        if written is None:
            torch.ops.aten.index_put_.default(self, positions_form(indices), values, False)
        else:
            # Where self is not batched and the result is, copy_ refuses as any write of a batched value into an
            # unbatched tensor does, and use() functionalizes the function.
            self.copy_(written)
        return None

    setitem.__name__ = "__setitem__"
    setitem.__qualname__ = "Tensor.__setitem__"
    return setitem
