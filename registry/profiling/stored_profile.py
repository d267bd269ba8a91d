"""``profile_into(store, ...)``: a profile run as the command line and the service's jobs make it: under the
benchmark lock, recorded in the store as a run (its timings come back invalid if another recorded run overlapped
it), written in one transaction when it is done, and this process's evidence reloaded so that its next decision
ranks by them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from registry.profiling import timing
from registry.store import evidence
from registry.store.benchlock import timed_run

if TYPE_CHECKING:
    import torch

    from registry.store.evidence_store import EvidenceStore
    from registry.store.records import ProfileEntry


def profile_into(store: EvidenceStore, *, ops: Iterable[str] | None, workloads: Sequence[str] | None,
                 numels: Sequence[int] = (1024,), batch_sizes: Sequence[int], dtypes: Sequence[torch.dtype],
                 device: str, min_run_time: float, progress: Callable[[int, int, str], None] | None = None,
                 refused: list[str] | None = None,
                 on_wait: Callable[[str, Path], None] | None = None) -> list[ProfileEntry]:
    """``profile(...)`` (``registry.profiling.timing``) under the benchmark lock, its timings written to ``store``;
    the timings. ``refused`` collects the contexts whose timings stayed disturbed (not stored); ``on_wait(holder,
    path)`` is called when another process holds the lock, before waiting for it."""
    # timing.profile looked up at the call: a caller may have wrapped it (tests widen its spread limit).
    profiles = timed_run(store, "profile", lambda: timing.profile(
        ops=ops, workloads=workloads, numels=numels, batch_sizes=batch_sizes, dtypes=dtypes, device=device,
        min_run_time=min_run_time, progress=progress, refused=refused), on_wait=on_wait)
    store.write_profiles(profiles)
    evidence.reload()
    return profiles
