"""What makes stored evidence stale: a hash of each composite's source, which every stored entry and profile keeps.

The store keeps only the entries whose hash matches the composite's source today, so an edit to a composite (or to a
helper in its module) retires what was measured of it. The selector reads evidence through that filter, so the hash
lives here in the core, beside the composites it describes.
"""

from __future__ import annotations

import functools
import hashlib
import inspect

from registry.core.model import Composite
from registry.core.registration import COMPOSITES, load


@functools.cache
def source_hash(composite: Composite) -> str:
    """The hash of the source of the composite's module (its helpers and Functions too) and its name."""
    module = inspect.getmodule(composite.fn)
    try:
        source = inspect.getsource(module) if module is not None else composite.source
    except (OSError, TypeError):
        source = composite.source
    return hashlib.sha256(f"{composite.name}\n{source}".encode()).hexdigest()[:16]


def source_hashes() -> dict[tuple[str, str], str]:
    """(op, composite name) -> its source hash, for every registered composite."""
    load()
    return {(op, name): source_hash(c) for op, composites in COMPOSITES.items() for name, c in composites.items()}
