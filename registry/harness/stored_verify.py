"""``verify_into(store, ...)``: a verify run as the command line and the service's jobs make it: recorded in the
store as a run that loads the machine (so that a profile beside it is marked), its entries written in one
transaction when it is done (which bumps the store's generation: running servers reload within a second), and this
process's evidence reloaded so that its next decision sees them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from registry.harness import verify as verifying
from registry.store import evidence
from registry.store.benchlock import recorded_run

if TYPE_CHECKING:
    import torch

    from registry.store.evidence_store import EvidenceStore
    from registry.store.records import MatrixEntry


def verify_into(store: EvidenceStore, *, ops: Iterable[str] | None, stacks: Iterable[str | Sequence[str]] | None,
                dtypes: Sequence[torch.dtype], progress: Callable[[int, int, str], None] | None = None,
                workers: int | None = None) -> list[MatrixEntry]:
    """``verify(ops, stacks, dtypes)`` (``registry.harness.verify``), its entries written to ``store``; the
    entries. Nothing is written of a run that fails or is interrupted."""
    with recorded_run(store, "verify"):
        entries = verifying.verify(ops=ops, stacks=stacks, dtypes=dtypes, progress=progress, workers=workers)
    store.write_entries(entries)
    evidence.reload()
    return entries
