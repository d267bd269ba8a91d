"""The evidence of a SQLite store, read with the standard library alone: what the first decision inside ``use()``
needs, without SQLAlchemy and Alembic (importing them and opening a ``Store`` cost about 0.3 s, six times the first
routed call's budget).

Only a store already at the newest schema revision is read here; any other (an older file that needs migrating, a
server URL) is read through ``Store``, which migrates a SQLite file on opening. The newest revision is read from the
migration scripts' text (each names its ``revision`` and ``down_revision``), not by importing Alembic.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from registry.store.connection import BUSY_TIMEOUT_MS
from registry.store.records import (
    MatrixEntry,
    ProfileEntry,
    matrix_entry_from_mapping,
    of_current_sources,
    profile_from_mapping,
)

VERSIONS = Path(__file__).parent / "migrations" / "versions"
_REVISION = re.compile(r'^revision(?:: *str)? *= *["\']([^"\']+)["\']', re.MULTILINE)
_DOWN = re.compile(r'^down_revision(?:: *[\w |]+)? *= *["\']([^"\']+)["\']', re.MULTILINE)


@cache
def head_revision() -> str:
    """The revision no other migration builds on: the schema this code reads and writes."""
    revisions, parents = set(), set()
    for script in VERSIONS.glob("*.py"):
        text = script.read_text(encoding="utf-8")
        if found := _REVISION.search(text):
            revisions.add(found.group(1))
        if down := _DOWN.search(text):
            parents.add(down.group(1))
    heads = revisions - parents
    if len(heads) != 1:
        raise RuntimeError(f"the migrations in {VERSIONS} have {len(heads)} heads ({', '.join(sorted(heads))}); "
                           "there must be one: give the newest migration the previous head as down_revision")
    return heads.pop()


def sqlite_path(url: str) -> str | None:
    """The file of a ``sqlite:///`` URL, or None (a server, or an in-memory database)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url.removeprefix("sqlite:///").split("?", 1)[0]
    return path if path and path != ":memory:" else None


# The order Store reads them in, so that evidence is indexed alike whichever reader loaded it.
_ORDER = {"matrix_entries": "op, composite, stack, pattern, dtype, id",
          "profiles": "op, workload, numel_bucket, batch_size, composite"}


def _read(path: str, table: str, convert: Callable[[Mapping[str, Any]], Any], torch_version: str,
          timeout_s: float) -> list[Any] | None:
    try:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error:
        return None
    try:
        connection.row_factory = sqlite3.Row
        version = connection.execute("SELECT version_num FROM alembic_version").fetchall()
        if [row[0] for row in version] != [head_revision()]:
            return None  # older (or newer) schema: Store migrates it, or says what to do
        query = f"SELECT * FROM {table} WHERE torch_version = ? ORDER BY {_ORDER[table]}"  # both names are ours
        rows = connection.execute(query, (torch_version,)).fetchall()
        return [convert(row) for row in rows]
    except sqlite3.Error:
        return None  # locked past the timeout, not a database, no such table: Store says what is wrong
    finally:
        connection.close()


def _fresh(url: str, table: str, convert: Callable[[Mapping[str, Any]], Any],
           source_hashes: Mapping[tuple[str, str], str], torch_version: str, timeout_s: float) -> list[Any] | None:
    path = sqlite_path(url)
    rows = None if path is None else _read(path, table, convert, torch_version, timeout_s)
    return None if rows is None else of_current_sources(rows, source_hashes)


def fresh_entries(url: str, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str,
                  timeout_s: float = BUSY_TIMEOUT_MS / 1000) -> list[MatrixEntry] | None:
    """The matrix rows fresh for these sources and this torch, or None where this reader cannot tell (``timeout_s``:
    how long to wait for a lock another process holds)."""
    return _fresh(url, "matrix_entries", matrix_entry_from_mapping, source_hashes, torch_version, timeout_s)


def fresh_profiles(url: str, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str,
                   timeout_s: float = BUSY_TIMEOUT_MS / 1000) -> list[ProfileEntry] | None:
    """The timings fresh for these sources and this torch, or None where this reader cannot tell."""
    return _fresh(url, "profiles", profile_from_mapping, source_hashes, torch_version, timeout_s)
