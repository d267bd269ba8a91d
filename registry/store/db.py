"""Persistence for the compatibility matrix: one row per op, composite, stack, pattern, dtype, device, torch version."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Engine,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    bindparam,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy.engine import Row

STATUSES: tuple[str, ...] = ("ok", "slow", "error", "mismatch", "unsupported")
ENV_VAR = "MULTICOMPOSITE_DB"
BUSY_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class MatrixEntry:
    """One verified cell: how ``composite`` of ``op`` fared under ``stack`` for one batching pattern and dtype."""

    op: str
    composite: str
    kind: str
    stack: tuple[str, ...]  # transform names, outermost first; () is eager
    pattern: str
    dtype: str
    status: str
    detail: str
    max_abs_error: float | None
    max_rel_error: float | None
    source_hash: str
    torch_version: str
    device: str


_metadata = MetaData()
_matrix = Table(
    "matrix_entries",
    _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("op", String(200), nullable=False, index=True),
    Column("composite", String(200), nullable=False),
    Column("kind", String(100), nullable=False),
    Column("stack", String(400), nullable=False),
    Column("pattern", String(100), nullable=False),
    Column("dtype", String(50), nullable=False),
    Column("status", String(20), nullable=False),
    Column("detail", Text, nullable=False),
    Column("max_abs_error", Float, nullable=True),
    Column("max_rel_error", Float, nullable=True),
    Column("source_hash", String(200), nullable=False),
    Column("torch_version", String(100), nullable=False),
    Column("device", String(50), nullable=False),
    UniqueConstraint("op", "composite", "stack", "pattern", "dtype", "device", "torch_version", name="uq_matrix_key"),
)
_KEY = ("op", "composite", "stack", "pattern", "dtype", "device", "torch_version")


@dataclass(frozen=True)
class ProfileEntry:
    """One timing: ``composite`` of ``op`` under ``stack`` (as the op sees it) at one size, batch and dtype."""

    op: str
    composite: str
    kind: str
    stack: tuple[str, ...]
    workload: str  # the user-level transform the timing ran under: "vmap(grad)", "jacrev", ...
    dtype: str
    device: str
    device_name: str
    numel_bucket: int  # the op's element count (per sample under vmap), rounded up to a power of two
    batch_size: int
    valid: bool
    detail: str  # why it is invalid, or ""
    median_us: float | None
    iqr_us: float | None
    runs: int
    peak_memory: int | None  # bytes, on CUDA
    source_hash: str
    torch_version: str


_profiles = Table(
    "profiles",
    _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("op", String(200), nullable=False, index=True),
    Column("composite", String(200), nullable=False),
    Column("kind", String(100), nullable=False),
    Column("stack", String(400), nullable=False),
    Column("workload", String(100), nullable=False),
    Column("dtype", String(50), nullable=False),
    Column("device", String(50), nullable=False),
    Column("device_name", String(200), nullable=False),
    Column("numel_bucket", Integer, nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("valid", Integer, nullable=False),
    Column("detail", Text, nullable=False),
    Column("median_us", Float, nullable=True),
    Column("iqr_us", Float, nullable=True),
    Column("runs", Integer, nullable=False),
    Column("peak_memory", Integer, nullable=True),
    Column("source_hash", String(200), nullable=False),
    Column("torch_version", String(100), nullable=False),
    UniqueConstraint("op", "composite", "workload", "dtype", "device", "device_name", "numel_bucket", "batch_size",
                     "torch_version", name="uq_profile_key"),
)
_PROFILE_KEY = ("op", "composite", "workload", "dtype", "device", "device_name", "numel_bucket", "batch_size",
                "torch_version")


def default_url() -> str:
    """``$MULTICOMPOSITE_DB`` if set, else a SQLite file in the user data dir (created if missing)."""
    url = os.environ.get(ENV_VAR)
    if url:
        return url
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    folder = Path(base) / "multicomposite"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'multicomposite.db'}"


def _encode_stack(stack: tuple[str, ...]) -> str:
    for name in stack:
        # A comma or an empty name could not be told apart after joining.
        if not name or "," in name:
            raise ValueError(f"invalid transform name in stack {stack!r}: {name!r}")
    return ",".join(stack)


def _decode_stack(value: str) -> tuple[str, ...]:
    return tuple(value.split(",")) if value else ()


def _to_row(entry: MatrixEntry) -> dict[str, Any]:
    if entry.status not in STATUSES:
        where = f"{entry.op}/{entry.composite}"
        raise ValueError(f"invalid status {entry.status!r} for {where}; valid: {', '.join(STATUSES)}")
    return {
        "op": entry.op,
        "composite": entry.composite,
        "kind": entry.kind,
        "stack": _encode_stack(tuple(entry.stack)),
        "pattern": entry.pattern,
        "dtype": entry.dtype,
        "status": entry.status,
        "detail": entry.detail,
        "max_abs_error": entry.max_abs_error,
        "max_rel_error": entry.max_rel_error,
        "source_hash": entry.source_hash,
        "torch_version": entry.torch_version,
        "device": entry.device,
    }


def _from_row(row: Row[Any]) -> MatrixEntry:
    m = row._mapping
    return MatrixEntry(
        op=m["op"],
        composite=m["composite"],
        kind=m["kind"],
        stack=_decode_stack(m["stack"]),
        pattern=m["pattern"],
        dtype=m["dtype"],
        status=m["status"],
        detail=m["detail"],
        max_abs_error=m["max_abs_error"],
        max_rel_error=m["max_rel_error"],
        source_hash=m["source_hash"],
        torch_version=m["torch_version"],
        device=m["device"],
    )


def _profile_from_row(row: Row[Any]) -> ProfileEntry:
    values = dict(row._mapping)
    values.pop("id")
    return ProfileEntry(**{**values, "stack": _decode_stack(values["stack"]), "valid": bool(values["valid"])})


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets readers proceed while a writer commits and keeps the file consistent if a writer is killed.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


class Store:
    """The compatibility matrix in a SQL database (SQLite by default)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url if url is not None else default_url()
        self.engine: Engine = create_engine(self.url)
        self._sqlite = self.engine.dialect.name == "sqlite"
        if self._sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        _metadata.create_all(self.engine)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_entries(self, entries: Iterable[MatrixEntry]) -> int:
        """Upsert ``entries`` in one transaction and return how many were given. On any error nothing is written.

        Within one call, a later entry with the same key replaces an earlier one, as across calls.
        """
        # Validate everything before touching the database, so a bad entry never leaves a partial batch.
        given = [_to_row(entry) for entry in entries]
        if not given:
            return 0
        rows = list({tuple(row[name] for name in _KEY): row for row in given}.values())
        # Delete-then-insert is a portable upsert; both run in one transaction so the replacement is atomic.
        key_match = and_(*(_matrix.c[name] == bindparam(f"k_{name}") for name in _KEY))
        deletes = [{f"k_{name}": row[name] for name in _KEY} for row in rows]
        with self.engine.begin() as conn:
            conn.execute(_matrix.delete().where(key_match), deletes)
            conn.execute(_matrix.insert(), rows)
        return len(given)

    def entries(
        self, *, op: str | None = None, stack: tuple[str, ...] | None = None, composite: str | None = None
    ) -> list[MatrixEntry]:
        """All stored rows matching the filters, ordered by op, composite, stack, pattern, dtype."""
        query = select(_matrix)
        if op is not None:
            query = query.where(_matrix.c.op == op)
        if stack is not None:
            query = query.where(_matrix.c.stack == _encode_stack(tuple(stack)))
        if composite is not None:
            query = query.where(_matrix.c.composite == composite)
        query = query.order_by(
            _matrix.c.op, _matrix.c.composite, _matrix.c.stack, _matrix.c.pattern, _matrix.c.dtype, _matrix.c.id
        )
        with self.engine.connect() as conn:
            return [_from_row(row) for row in conn.execute(query)]

    def fresh_entries(
        self, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str, op: str | None = None
    ) -> list[MatrixEntry]:
        """Rows still valid: their (op, composite) source hash and torch version match. Stale rows stay stored."""
        query = select(_matrix).where(_matrix.c.torch_version == torch_version)
        if op is not None:
            query = query.where(_matrix.c.op == op)
        query = query.order_by(
            _matrix.c.op, _matrix.c.composite, _matrix.c.stack, _matrix.c.pattern, _matrix.c.dtype, _matrix.c.id
        )
        with self.engine.connect() as conn:
            rows = [_from_row(row) for row in conn.execute(query)]
        return [e for e in rows if source_hashes.get((e.op, e.composite)) == e.source_hash]

    def write_profiles(self, profiles: Iterable[ProfileEntry]) -> int:
        """Upsert ``profiles`` in one transaction (an interrupted run leaves earlier results intact)."""
        rows = [{**vars(p), "stack": _encode_stack(tuple(p.stack)), "valid": int(p.valid)} for p in profiles]
        if not rows:
            return 0
        unique = list({tuple(row[name] for name in _PROFILE_KEY): row for row in rows}.values())
        key_match = and_(*(_profiles.c[name] == bindparam(f"k_{name}") for name in _PROFILE_KEY))
        with self.engine.begin() as conn:
            conn.execute(_profiles.delete().where(key_match),
                         [{f"k_{name}": row[name] for name in _PROFILE_KEY} for row in unique])
            conn.execute(_profiles.insert(), unique)
        return len(rows)

    def profiles(self, *, op: str | None = None, stack: tuple[str, ...] | None = None, dtype: str | None = None,
                 device: str | None = None) -> list[ProfileEntry]:
        """Stored timings matching the filters."""
        query = select(_profiles)
        for column, value in (("op", op), ("dtype", dtype), ("device", device)):
            if value is not None:
                query = query.where(_profiles.c[column] == value)
        if stack is not None:
            query = query.where(_profiles.c.stack == _encode_stack(tuple(stack)))
        query = query.order_by(_profiles.c.op, _profiles.c.workload, _profiles.c.numel_bucket,
                               _profiles.c.batch_size, _profiles.c.composite)
        with self.engine.connect() as conn:
            return [_profile_from_row(row) for row in conn.execute(query)]

    def fresh_profiles(self, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str,
                       op: str | None = None) -> list[ProfileEntry]:
        """Timings still valid for these composite sources and this torch."""
        return [p for p in self.profiles(op=op)
                if p.torch_version == torch_version and source_hashes.get((p.op, p.composite)) == p.source_hash]

    def clear(self) -> None:
        """Delete every row."""
        with self.engine.begin() as conn:
            conn.execute(_matrix.delete())
            conn.execute(_profiles.delete())

    def integrity_ok(self) -> bool:
        """SQLite's ``PRAGMA integrity_check`` answered "ok"; always True for other backends."""
        if not self._sqlite:
            return True
        with self.engine.connect() as conn:
            answers = [str(row[0]) for row in conn.execute(text("PRAGMA integrity_check"))]
        return answers == ["ok"]

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()
