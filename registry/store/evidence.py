"""The store's evidence source for the selector: the verified matrix and the profiles, indexed by context.

``registry/__init__`` registers ``SOURCE`` with ``registry.core.evidence``; the selector asks it for the worst failing
entry and the timings of a context. The entries come from ``use_loader``/``set_entries`` or, by default, from the
default store, read at the first decision that needs them (and only if a store exists: nothing is created).

Policy ``auto`` treats a failing entry (``slow``, ``error``, ``mismatch``) for the current context as a problem of
that composite, on top of the rules; ``ok`` entries make a decision "verified" but never overrule a rule, because
an entry speaks for the samples that were run, and a rule may know of an overload they did not cover.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from registry.core.collector import collection_paused
from registry.core.context import Context
from registry.core.evidence import Evidence, Timing
from registry.core.selector import clear_cache
from registry.core.sources import source_hashes
from registry.core.stacks import format_stack
from registry.core.status import FAILING, worst
from registry.store import health
from registry.store.connection import StoreUnavailableError, default_store_exists, default_url, shown_url
from registry.store.health import HEALTH, StoreStatus, describe, store_errors
from registry.store.records import MatrixEntry

__all__ = ["FAILING", "SOURCE", "Evidence", "StoreEvidence", "Timing", "clear", "evidence", "reload", "set_entries",
           "set_profiles", "store_status", "stored_entries", "stored_profiles", "timings", "use_loader",
           "use_profile_loader", "use_store"]


_lock = threading.Lock()
_index: dict[tuple[str, str, tuple[str, ...]], list[Any]] | None = None
_loader: Any = None  # a callable returning the entries to use, set by ``use_loader``
# Timings: (op, stack) -> valid profile entries; loaded with the matrix.
_profiles: dict[tuple[str, tuple[str, ...]], list[Any]] | None = None
_profile_loader: Any = None


def set_entries(entries: Iterable[MatrixEntry]) -> None:
    """Index ``entries`` as the evidence (replacing what was there)."""
    global _index
    index: dict[tuple[str, str, tuple[str, ...]], list[Any]] = {}
    for entry in entries:
        index.setdefault((entry.op, entry.composite, tuple(entry.stack)), []).append(entry)
    with _lock:
        _index = index
    _changed()


def clear() -> None:
    set_entries(())
    set_profiles(())


def set_profiles(profiles: Iterable[Any]) -> None:
    """Index ``profiles`` (ProfileEntry-like) as the timings policy ``auto`` ranks by."""
    global _profiles
    index: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
    for profile in profiles:
        if profile.valid and profile.median_us is not None:
            index.setdefault((profile.op, tuple(profile.stack)), []).append(profile)
    with _lock:
        _profiles = index
    _changed()


def use_profile_loader(loader: Any) -> None:
    """Load timings lazily from ``loader()`` (default: the store's fresh profiles)."""
    global _profiles, _profile_loader
    with _lock:
        _profile_loader, _profiles = loader, None
    _changed()


def stored_profiles() -> list[Any]:
    """The default timings: the store's fresh profiles."""
    return _read_default_store("fresh_profiles")


def timings(op: str, ctx: Context, candidates: Iterable[str]) -> dict[str, Timing]:
    """Measured scores of ``candidates`` at the profiled size nearest to ``ctx.numel`` (same dtype and device)."""
    global _profiles
    if _profiles is None:
        with collection_paused():  # long-lived records and no garbage, as registration (core/collector.py)
            loaded = list((_profile_loader or stored_profiles)())
        set_profiles(loaded)
    stack = tuple(t for t in ctx.stack if t != "autograd")
    dtype = str(ctx.dtype).removeprefix("torch.") if ctx.dtype is not None else None
    rows = [p for p in (_profiles or {}).get((op, stack), [])
            if (dtype is None or p.dtype == dtype) and (ctx.device is None or p.device == ctx.device)]
    wanted = set(candidates)
    rows = [p for p in rows if p.composite in wanted]
    if not rows:
        return {}
    target = (ctx.numel or 1).bit_length()
    nearest = min({p.numel_bucket for p in rows}, key=lambda b: (abs(b.bit_length() - target), b))
    rows = [p for p in rows if p.numel_bucket == nearest]
    by_composite: dict[str, dict[int, float]] = {}
    spreads: dict[tuple[str, int], float] = {}
    for p in rows:
        by_composite.setdefault(p.composite, {})[p.batch_size] = p.median_us
        spreads[p.composite, p.batch_size] = (p.iqr_us or 0.0) / p.median_us
    shared = set.intersection(*(set(v) for v in by_composite.values()))
    result = {}
    for name, medians in by_composite.items():
        sizes = tuple(sorted(shared or medians))
        logs = [math.log(medians[b]) for b in sizes if b in medians]
        spread = max(spreads[name, b] for b in sizes if b in medians)
        result[name] = Timing(name, math.exp(sum(logs) / len(logs)), nearest, sizes, spread)
    return result


def use_loader(loader: Any) -> None:
    """Load evidence lazily from ``loader()`` at the first decision that needs it (the store, by default)."""
    global _index, _loader
    with _lock:
        _loader, _index = loader, None
    _changed()


def reload() -> None:
    """Drop the loaded entries and timings, keeping where they come from: the next decision reads them again (after
    this process wrote the store, so that its own decisions see what it wrote)."""
    global _index, _profiles
    with _lock:
        _index, _profiles = None, None
    _changed()


def _changed() -> None:
    clear_cache()


_warned: list[bool] = []  # the missing-SQLAlchemy warning was given


def _read_default_store(read: str) -> list[Any]:
    """``registry.store.fresh.<read>``: the entries fresh for this torch and these composites' sources, from the
    default store; nothing (and one warning a process, ``registry.store.health``) where it cannot be read."""
    if HEALTH.failing():
        return []  # it failed a moment ago: the background retry reads it next
    try:
        return _read_store(read)
    except store_errors() as error:
        HEALTH.failed(_shown_url(), error, stacklevel=3)
        return []


def _shown_url() -> str | None:
    try:
        return shown_url(default_url())
    except OSError:  # no data folder can be made: there is no default store
        return None


def _read_store(read: str) -> list[Any]:
    """What ``_read_default_store`` reads; raises what ``store_errors()`` names.

    Nothing is created: without a store (no ``MULTICOMPOSITE_DB`` and no SQLite file yet, or a SQLite file named
    there but not made yet) there is no evidence, and SQLAlchemy is not imported; nor is it for a SQLite store at the
    newest schema (``sqlite_reader``, the standard library's driver). With a store but without SQLAlchemy (the
    library installed without its ``service`` extra) the rules decide, and a warning says how to read the store.
    Every wait is bounded by ``health.READ_TIMEOUT_S``.
    """
    import torch

    if not default_store_exists():
        return []
    from registry.store import sqlite_reader

    url = default_url()
    path = sqlite_reader.sqlite_path(url)
    if path is not None and not os.path.exists(path):
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise StoreUnavailableError(f"the folder {folder} of the store file does not exist")
        if url in HEALTH.read:
            raise StoreUnavailableError(f"the store file {path} was read earlier and does not exist now")
        return []  # named but never written: nothing measured yet
    read_fresh = getattr(sqlite_reader, read)
    stored = read_fresh(url, source_hashes=source_hashes(), torch_version=torch.__version__,
                        timeout_s=health.READ_TIMEOUT_S)
    if stored is not None:
        HEALTH.succeeded(url)
        return stored
    try:
        from registry.store import fresh
        from registry.store.evidence_store import EvidenceStore
    except ModuleNotFoundError as error:
        if not _warned:  # once a process: the matrix and the profiles are read apart
            _warned.append(True)
            warnings.warn(f"the store at {shown_url(url)} is not read: {error.name} is not installed, so the rules "
                          "alone decide; pip install 'multicomposite[service]' to use its evidence", stacklevel=3)
        return []
    # A reader never makes the file: a SQLite store deleted since the check above (or while a retry was due) must
    # not come back as a new, empty one that a server then takes for its own.
    opened = url if path is None else f"sqlite:///file:{quote(os.path.abspath(path))}?mode=rw&uri=true"
    store = EvidenceStore(opened, timeout_s=health.READ_TIMEOUT_S)
    try:
        result = getattr(fresh, read)(store)
    finally:
        store.close()
    HEALTH.succeeded(url)
    return result


def store_status() -> StoreStatus:
    """Which store ``use()`` reads its evidence from, and whether it can read it now (one bounded read). A read that
    succeeds while the evidence was left out for a failed one reloads it."""
    try:
        exists = default_store_exists()
        url = default_url()
    except OSError as error:
        return StoreStatus(None, False, False, describe(error))
    path = None
    if exists:
        from registry.store import sqlite_reader

        path = sqlite_reader.sqlite_path(url)
    if not exists or (path is not None and not os.path.exists(path) and url not in HEALTH.read
                      and os.path.isdir(os.path.dirname(os.path.abspath(path)))):
        return StoreStatus(shown_url(url), False, False)
    failing = HEALTH.problem is not None
    try:
        _read_store("fresh_entries")
    except store_errors() as error:
        return StoreStatus(shown_url(url), True, False, describe(error))
    if failing:
        reload()
    return StoreStatus(shown_url(url), True, True)


def use_store(store: Any) -> None:
    """Read evidence from ``store`` (an open EvidenceStore) from now on: reloaded lazily at the next decision."""
    from registry.store.fresh import fresh_entries, fresh_profiles

    use_loader(lambda: fresh_entries(store))
    use_profile_loader(lambda: fresh_profiles(store))


def stored_entries() -> list[Any]:
    """The default evidence: the store's fresh matrix entries."""
    return _read_default_store("fresh_entries")


def _entries(op: str, composite: str, stack: tuple[str, ...]) -> list[Any]:
    global _index
    if _index is None:
        with collection_paused():  # long-lived records and no garbage, as registration (core/collector.py)
            loaded = list((_loader or stored_entries)())
        index: dict[tuple[str, str, tuple[str, ...]], list[Any]] = {}
        for entry in loaded:
            index.setdefault((entry.op, entry.composite, tuple(entry.stack)), []).append(entry)
        with _lock:
            _index = index
    return _index.get((op, composite, stack), [])


def patterns_of(ctx: Context, tensor_args: tuple[str, ...]) -> set[str]:
    """The matrix patterns that describe ``ctx``'s batching."""
    if "vmap" not in ctx.stack:
        return {"-"}
    batched = set(ctx.batched)
    if batched == {"self"}:
        return {"self"}
    if "self" not in batched:
        return {"others"}
    if batched >= set(ctx.tensors) & set(tensor_args):
        return {"all", "in_dims1"}
    return {"all"}


def evidence(op: str, composite: str, ctx: Context, tensor_args: tuple[str, ...]) -> tuple[Evidence | None, int]:
    """(the worst failing entry that applies to ``ctx``, or None; how many entries apply)."""
    stack = tuple(t for t in ctx.stack if t != "autograd")
    applicable = [
        e for e in _entries(op, composite, stack)
        if (ctx.dtype is None or e.dtype == str(ctx.dtype).removeprefix("torch."))
        and (e.pattern == "-" or e.pattern in patterns_of(ctx, tensor_args))
    ]
    failing = [e for e in applicable if e.status in FAILING]
    if not failing:
        return None, len(applicable)
    status = worst(e.status for e in failing)
    chosen = next(e for e in failing if e.status == status)
    amount = f" {chosen.max_abs_error:.3g}" if status == "mismatch" and chosen.max_abs_error is not None else ""
    where = format_stack(stack) or "no transform"
    text = f"{composite}: {status}{amount} under {where}, pattern {chosen.pattern}, {chosen.dtype}"
    return Evidence(status, text), len(applicable)


class StoreEvidence:
    """The evidence source this module is: what ``registry.core.evidence`` asks, answered from the index above."""

    def evidence(self, op: str, composite: str, ctx: Context,
                 tensor_args: tuple[str, ...]) -> tuple[Evidence | None, int]:
        return evidence(op, composite, ctx, tensor_args)

    def timings(self, op: str, ctx: Context, candidates: Iterable[str]) -> dict[str, Timing]:
        return timings(op, ctx, candidates)


SOURCE = StoreEvidence()

# A store that could not be read is tried again in the background; once it reads, the evidence reloads.
HEALTH.probe = functools.partial(_read_store, "fresh_entries")
HEALTH.on_recovery = reload
