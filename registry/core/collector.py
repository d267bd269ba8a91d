"""Registration without a cyclic garbage collection in its middle.

Registering the routing kernels makes a few thousand long-lived objects (deciders, Python kernels, their closures)
and no garbage. Right after ``import torch`` and ``import registry`` the collector owes a full collection of that
whole heap (about 40 ms on 2-core x86_64, torch 2.13.0 CPU); those allocations would trigger it inside the first
``use()``, although registration adds nothing for it to free. Pausing the collector while registering (and while
the composite families are imported and the first decision loads the store's evidence, as many long-lived objects),
then collecting the young generation alone, leaves that collection where it would have come without routing: at the
program's own later allocations.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block, re-enabling it only if it was enabled before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            # The block's allocations passed the young generation's threshold: collected here alone (about a
            # millisecond), they leave the older generations' counts as they were, so the first allocation after
            # the block does not start the cascade into the full collection that the imports left owing.
            gc.collect(0)
            gc.enable()
