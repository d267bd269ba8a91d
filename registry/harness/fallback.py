"""vmap's fallback warning: how a check tells a slow pass (vmap looped over the batch in Python) from a fast one.

PyTorch warns "There is a performance drop ..." when vmap has no batching rule for an op and falls back to a loop;
the warning is off by default and has no getter, so ``watch`` turns it on for the block and off again afterwards.

Some batching rules loop without the warning: functorch's ``index_add`` rule runs ``index_add`` once per sample in
C++ where the index is batched. ``KernelCalls`` counts what reaches the kernels below every transform, so that a
check can compare the transformed call's count of the op with one sample's (``silent_loop_note``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 - TorchDispatchMode has no public home

from registry.core.messages import DETAIL_LIMIT, first_line

FALLBACK_WARNING = "There is a performance drop"


@contextlib.contextmanager
def watch() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised in the block, vmap's fallback warning turned on."""
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)


def fallback_note(caught: Sequence[warnings.WarningMessage], limit: int = DETAIL_LIMIT) -> str | None:
    """The first line of the first fallback warning among ``caught`` (a slow outcome's detail), or None."""
    slow = [w.message for w in caught if FALLBACK_WARNING in str(w.message)]
    return first_line(slow[0], limit) if slow else None


class KernelCalls(TorchDispatchMode):
    """How often each op (its overload packet's name: ``index_add`` for ``index_add.default`` and ``.out``) reaches
    the kernels below every transform while the mode is on. A Python dispatch mode sees each call once the transforms
    above it have done their work, so a batching rule's loop shows as one call per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def of(self, op: str) -> int:
        """The calls of ``op`` and of its in-place form."""
        return self.counts.get(op, 0) + self.counts.get(f"{op}_", 0)


def silent_loop_note(op: str, transformed: KernelCalls, reference: KernelCalls, samples: int) -> str | None:
    """A slow outcome's detail where the transformed call ran ``op`` as often as the per-sample reference loop over
    ``samples`` samples did (a batching rule that loops without the warning), or None."""
    batched, looped = transformed.of(op), reference.of(op)
    if samples < 2 or looped < samples or batched < looped:
        return None
    return (f"vmap ran aten::{op} once per sample ({batched} calls for {samples} samples, as the per-sample loop): "
            "its batching rule loops without vmap's warning")
