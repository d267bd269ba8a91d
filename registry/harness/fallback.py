"""vmap's fallback warning: how a check tells a slow pass (vmap looped over the batch in Python) from a fast one.

PyTorch warns "There is a performance drop ..." when vmap has no batching rule for an op and falls back to a loop;
the warning is off by default and has no getter, so ``watch`` turns it on for the block and off again afterwards.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch

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
