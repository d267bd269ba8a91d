"""The evidence store: the verified matrix, the timings (profiles) and the benchmarking runs that tell a timing
whether another process ran while it timed, with the generation that counts the evidence writes. The survey's,
conformance's and checks' tables (``survey``, ``conformance``, ``checks``) are written and read through it too.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Row

from registry.core.status import STATUSES
from registry.store.database import Database
from registry.store.processes import process_alive
from registry.store.records import (
    MATRIX_KEY,
    PROFILE_KEY,
    BenchRun,
    MatrixEntry,
    ProfileEntry,
    matrix_entry_from_mapping,
    of_current_sources,
    profile_from_mapping,
)
from registry.store.tables import GENERATION, encode_stack, mapped_record, meta_table, upsert

MatrixRow = mapped_record(MatrixEntry, "matrix_entries", MATRIX_KEY, "uq_matrix_key")
ProfileRow = mapped_record(ProfileEntry, "profiles", PROFILE_KEY, "uq_profile_key")
BenchRunRow = mapped_record(BenchRun, "bench_runs")
_MATRIX_ORDER = tuple(getattr(MatrixRow, name) for name in ("op", "composite", "stack", "pattern", "dtype", "id"))


def _to_row(entry: MatrixEntry) -> dict[str, Any]:
    if entry.status not in STATUSES:
        where = f"{entry.op}/{entry.composite}"
        raise ValueError(f"invalid status {entry.status!r} for {where}; valid: {', '.join(STATUSES)}")
    return {
        "op": entry.op,
        "composite": entry.composite,
        "kind": entry.kind,
        "stack": encode_stack(tuple(entry.stack)),
        "pattern": entry.pattern,
        "dtype": entry.dtype,
        "status": entry.status,
        "detail": entry.detail,
        "max_abs_error": entry.max_abs_error,
        "max_rel_error": entry.max_rel_error,
        "source_hash": entry.source_hash,
        "torch_version": entry.torch_version,
        "device": entry.device,
        "measured_at": entry.measured_at,
    }


def _from_row(row: Row[Any]) -> MatrixEntry:
    return matrix_entry_from_mapping(row._mapping)


def _profile_from_row(row: Row[Any]) -> ProfileEntry:
    return profile_from_mapping(row._mapping)


class EvidenceStore(Database):
    """The evidence in a SQL database (SQLite by default): the matrix, the profiles and the benchmarking runs."""

    @staticmethod
    def _bump(conn: Any) -> None:
        """Count one write of evidence. Called first in a writing transaction: on PostgreSQL the row lock it takes
        queues evidence writers one after another (as SQLite's one writer does), so their upserts never deadlock,
        and the counter, read and incremented under that lock, counts every write."""
        conn.execute(update(meta_table).where(meta_table.c.key == GENERATION).values(value=meta_table.c.value + 1))

    def generation(self) -> int:
        """How many times evidence was written: compare it with a remembered value to see whether to reload."""
        with self.reading() as conn:
            value = conn.execute(select(meta_table.c.value).where(meta_table.c.key == GENERATION)).scalar()
        return int(value or 0)

    def write_entries(self, entries: Iterable[MatrixEntry]) -> int:
        """Upsert ``entries`` in one transaction and return how many were given. On any error nothing is written.

        Within one call, a later entry with the same key replaces an earlier one, as across calls.
        """
        # Validate everything before touching the database, so a bad entry never leaves a partial batch.
        given = [_to_row(entry) for entry in entries]
        if not given:
            return 0
        rows = list({tuple(row[name] for name in MATRIX_KEY): row for row in given}.values())
        with self.writing() as conn:
            self._bump(conn)
            upsert(conn, MatrixRow.__table__, rows, MATRIX_KEY)
        return len(given)

    def entries(
        self, *, op: str | None = None, stack: tuple[str, ...] | None = None, composite: str | None = None
    ) -> list[MatrixEntry]:
        """All stored rows matching the filters, ordered by op, composite, stack, pattern, dtype."""
        query = select(MatrixRow)
        if op is not None:
            query = query.where(MatrixRow.op == op)
        if stack is not None:
            query = query.where(MatrixRow.stack == encode_stack(tuple(stack)))
        if composite is not None:
            query = query.where(MatrixRow.composite == composite)
        query = query.order_by(*_MATRIX_ORDER)
        with self.reading() as conn:
            return [_from_row(row) for row in conn.execute(query)]

    def fresh_entries(
        self, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str, op: str | None = None
    ) -> list[MatrixEntry]:
        """Rows still valid: their (op, composite) source hash and torch version match. Stale rows stay stored."""
        query = select(MatrixRow).where(MatrixRow.torch_version == torch_version)
        if op is not None:
            query = query.where(MatrixRow.op == op)
        query = query.order_by(*_MATRIX_ORDER)
        with self.reading() as conn:
            rows = [_from_row(row) for row in conn.execute(query)]
        return of_current_sources(rows, source_hashes)

    def write_profiles(self, profiles: Iterable[ProfileEntry]) -> int:
        """Upsert ``profiles`` in one transaction (an interrupted run leaves earlier results intact)."""
        rows = [{**vars(p), "stack": encode_stack(tuple(p.stack)), "valid": int(p.valid)} for p in profiles]
        if not rows:
            return 0
        unique = list({tuple(row[name] for name in PROFILE_KEY): row for row in rows}.values())
        with self.writing() as conn:
            self._bump(conn)
            upsert(conn, ProfileRow.__table__, unique, PROFILE_KEY)
        return len(rows)

    def profiles(self, *, op: str | None = None, stack: tuple[str, ...] | None = None, dtype: str | None = None,
                 device: str | None = None) -> list[ProfileEntry]:
        """Stored timings matching the filters."""
        query = select(ProfileRow)
        for column, value in (("op", op), ("dtype", dtype), ("device", device)):
            if value is not None:
                query = query.where(getattr(ProfileRow, column) == value)
        if stack is not None:
            query = query.where(ProfileRow.stack == encode_stack(tuple(stack)))
        query = query.order_by(ProfileRow.op, ProfileRow.workload, ProfileRow.numel_bucket,
                               ProfileRow.batch_size, ProfileRow.composite)
        with self.reading() as conn:
            return [_profile_from_row(row) for row in conn.execute(query)]

    def profile_devices(self) -> list[str]:
        """The device types stored timings name (one indexed scan, no rows built)."""
        with self.reading() as conn:
            return sorted(row[0] for row in conn.execute(select(ProfileRow.device).distinct()))

    def fresh_profiles(self, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str,
                       op: str | None = None) -> list[ProfileEntry]:
        """Timings still valid for these composite sources and this torch."""
        return of_current_sources((p for p in self.profiles(op=op) if p.torch_version == torch_version), source_hashes)

    def clear(self) -> None:
        """Delete every row."""
        with self.writing() as conn:
            self._bump(conn)
            conn.execute(delete(MatrixRow))
            conn.execute(delete(ProfileRow))

    # Benchmarking runs -----------------------------------------------------------------------------------------

    def begin_run(self, kind: str) -> int:
        with self.writing() as conn:
            result = conn.execute(insert(BenchRunRow), [{"kind": kind, "host": socket.gethostname(), "pid": os.getpid(),
                                                        "started_at": time.time(), "finished_at": None}])
            return int(result.inserted_primary_key[0])

    def end_run(self, run_id: int) -> None:
        with self.writing() as conn:
            conn.execute(update(BenchRunRow).where(BenchRunRow.id == run_id).values(finished_at=time.time()))

    def overlapping_runs(self, run_id: int) -> list[BenchRun]:
        """Other runs whose time overlapped run ``run_id`` (an unfinished one counts while its process lives)."""
        with self.reading() as conn:
            mine = conn.execute(select(BenchRunRow).where(BenchRunRow.id == run_id)).one()
            end = mine.finished_at if mine.finished_at is not None else time.time()
            others = select(BenchRunRow).where(BenchRunRow.id != run_id, BenchRunRow.started_at < end)
            rows = conn.execute(others).all()
        overlapping = []
        for row in rows:
            run = BenchRun(**row._mapping)
            if run.finished_at is None and not process_alive(f"{run.host}:{run.pid}"):
                continue  # killed before it finished: it is not running now, and when it ran is unknown
            if run.finished_at is None or run.finished_at > mine.started_at:
                overlapping.append(run)
        return overlapping

