"""Boolean-mask indexing under vmap inside ``use()``: reads (``x[mask]``, ``edge_index[:, mask]``) and writes
(``x[mask] = v``) through a batched mask.

PyTorch's batching rule for ``aten::index.Tensor`` refuses a batched boolean index (each sample would select a
different number of elements). A kernel there turns the mask into the integer positions of its ``True`` entries
(``nonzero`` per sample, which agrees or splits the batch: registry.core.batch_split) and indexes with them; writes go
through ``Tensor.__setitem__`` (registry.core.mask_writes says why there). A kernel on ``index.Tensor`` would add a
Python call to every tensor index under every transform, so neither is put in place by ``install``: ``register()``
does it when the refusal is first seen inside ``use()`` (registry.core.functionalization), and ``uninstall`` takes
both out again.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from registry.core import dynamic, mask_writes
from registry.core.context import DISPATCH_KEY, vmap_levels

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



class MaskIndexing:
    """The boolean-index kernel and the ``__setitem__`` patch (``registry.core.patches.Patch``), registered on first
    need."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        self.libraries: list[torch.library.Library] = []  # kept alive: dropping one unregisters its kernel
        self.setitem: Callable[..., None] | None = None  # PyTorch's Tensor.__setitem__ while the write patch is in

    def install(self, active: Callable[[], bool]) -> None:
        """Only remember ``active``: the kernel and the patch wait for ``register()``."""
        with self.lock:
            self.active = active

    def registered(self) -> bool:
        return bool(self.libraries)

    def register(self) -> None:
        """Register the boolean-index kernel on ``aten::index.Tensor`` and patch ``Tensor.__setitem__`` for writes
        through a mask (once, until ``uninstall``)."""
        with self.lock:
            if self.libraries:
                return
            active = self.active
            if active is None:
                raise RuntimeError("mask indexing: register() called before install(); install the routing first "
                                   "(registry.install())")
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Warning only once for all operators")
                native = torch.library.get_kernel("aten::index.Tensor", DISPATCH_KEY)
                library.impl("index.Tensor", _make_mask_index(native, active), DISPATCH_KEY,
                             with_keyset=True)
            self.libraries.append(library)
            # Writes through the mask (x[mask] = v): torch.where where v has no per-element dimension, else the
            # mask's positions per sample (registry.core.mask_writes).
            self.setitem = torch.Tensor.__setitem__
            torch.Tensor.__setitem__ = mask_writes.make_setitem(self.setitem, active)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        """Remove the boolean-index kernel and restore ``Tensor.__setitem__``."""
        with self.lock:
            for library in self.libraries:
                library._destroy()
            self.libraries.clear()
            if self.setitem is not None:
                torch.Tensor.__setitem__ = self.setitem  # type: ignore[method-assign]
                self.setitem = None
            self.active = None


PATCH = MaskIndexing()  # the default registry's (``registry.core.patches.PATCHES``)
