"""What store-backed routes show, computed once per store generation: the fresh matrix and profiles, sorted by a
key that paging cursors point into."""

from __future__ import annotations

import base64
import binascii
import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.core.stacks import shorten
from registry.store.records import MatrixEntry, ProfileEntry
from service.state import StoreState
from service.validation import InputError


def matrix_key(entry: MatrixEntry) -> tuple:
    return (entry.op, entry.composite, entry.stack, entry.pattern, entry.dtype, entry.device)


def profile_key(profile: ProfileEntry) -> tuple:
    return (profile.op, profile.workload, profile.numel_bucket, profile.batch_size, profile.composite, profile.dtype,
            profile.device, profile.device_name)


@dataclass(frozen=True)
class Listing:
    items: list[Any]
    keys: list[list]  # each item's sort key as JSON gives it back (lists for tuples): what cursors hold


def _comparable(key: tuple) -> list:
    return [list(part) if isinstance(part, tuple) else part for part in key]


def _listing(items: list[Any], key: Callable[[Any], tuple]) -> Listing:
    items = sorted(items, key=key)
    return Listing(items, [_comparable(key(item)) for item in items])


def fresh_matrix(state: StoreState) -> Listing:
    """The store's entries fresh for this torch and these composites' sources (one read per generation)."""
    from registry.store import fresh

    store = state.require()
    return state.listings.get(state.generation, "matrix", lambda: _listing(fresh.fresh_entries(store), matrix_key))


def fresh_profiles(state: StoreState) -> Listing:
    from registry.store import fresh

    store = state.require()
    return state.listings.get(state.generation, "profiles", lambda: _listing(fresh.fresh_profiles(store),
                                                                             profile_key))


def encode_cursor(key: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> list:
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, list):
        raise InputError(f"cursor {shorten(cursor)!r} is not one this API gave out; start again without cursor")
    return key


def page(listing: Listing, keep: Callable[[Any], bool], limit: int, cursor: str | None
         ) -> tuple[list[Any], str | None, int]:
    """(up to ``limit`` kept items after ``cursor``, the cursor of the next page or None, how many are kept)."""
    start = 0
    if cursor is not None:
        after = decode_cursor(cursor)
        try:
            start = bisect.bisect_right(listing.keys, after)
        except TypeError:
            raise InputError(f"cursor {shorten(cursor)!r} is not one this API gave out; start again without "
                             "cursor") from None
    kept_total = 0
    chosen: list[Any] = []
    last = -1
    more = False
    for index, item in enumerate(listing.items):
        if not keep(item):
            continue
        kept_total += 1
        if index < start:
            continue
        if len(chosen) < limit:
            chosen.append(item)
            last = index
        else:
            more = True
    return chosen, encode_cursor(listing.keys[last]) if more else None, kept_total


def package_relative(where: str) -> str:
    """``/…/site-packages/composites/index.py:42`` -> ``composites/index.py:42``: the path from the folder that
    holds the top-level package, so no install path shows (a file outside any package shows its name alone)."""
    path, _, line = where.rpartition(":")
    if not path:
        return where
    file = Path(path)
    root = file.parent
    while (root / "__init__.py").is_file() and root.parent != root:
        root = root.parent
    return f"{file.relative_to(root).as_posix()}:{line}"


def verified_stacks(entries: Sequence[MatrixEntry], op: str) -> dict[str, list[tuple[str, ...]]]:
    """composite -> stacks where every stored entry of it is ok or unsupported, and at least one ok."""
    statuses: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for entry in entries:
        if entry.op == op:
            statuses.setdefault((entry.composite, entry.stack), set()).add(entry.status)
    verified: dict[str, list[tuple[str, ...]]] = {}
    for (name, stack), seen in statuses.items():
        if seen <= {"ok", "unsupported"} and "ok" in seen:
            verified.setdefault(name, []).append(stack)
    return verified
