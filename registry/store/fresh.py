"""What of the store is fresh: the matrix entries and profiles measured with this torch on these composites' sources
(a composite whose source changed since, or another torch, makes its rows stale). Every reader of evidence, the
selector's, the service's and the command line's, asks here, so they agree on what is current."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from registry.store.evidence_store import EvidenceStore
    from registry.store.records import MatrixEntry, ProfileEntry


def fresh_entries(store: EvidenceStore, **filters: Any) -> list[MatrixEntry]:
    """``store``'s matrix entries fresh for this torch and these composites' sources (``filters``: as
    ``EvidenceStore.fresh_entries`` takes them, e.g. ``op``)."""
    import torch

    from registry.core.sources import source_hashes

    return store.fresh_entries(source_hashes=source_hashes(), torch_version=torch.__version__, **filters)


def fresh_profiles(store: EvidenceStore, **filters: Any) -> list[ProfileEntry]:
    """``store``'s profiles fresh for this torch and these composites' sources."""
    import torch

    from registry.core.sources import source_hashes

    return store.fresh_profiles(source_hashes=source_hashes(), torch_version=torch.__version__, **filters)
