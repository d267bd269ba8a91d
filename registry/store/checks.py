"""The checks table: one row per ``registry.check`` report a check job stored (``records.CheckRecord``), and what is
read and written of it.

Defined on ``registry.store.tables``' metadata beside the others (the migrations' ``env.py`` imports this module so
that Alembic compares it too); revision 0006 adds it to an existing store.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import delete, insert, select

from registry.store.evidence_store import EvidenceStore
from registry.store.records import CheckRecord
from registry.store.tables import mapped_record

CheckRow = mapped_record(CheckRecord, "checks")  # report is JSON text: the column type converts it


def _record(row: Any) -> CheckRecord:
    return CheckRecord(**row._mapping)


def write_check(store: EvidenceStore, record: CheckRecord) -> None:
    """Store one check; a check of the same id (its job, run again) is replaced."""
    with store.writing() as conn:
        conn.execute(delete(CheckRow).where(CheckRow.id == record.id))
        conn.execute(insert(CheckRow).values(**dataclasses.asdict(record)))


def stored_checks(store: EvidenceStore, *, limit: int = 100) -> list[CheckRecord]:
    """The newest checks first, at most ``limit``."""
    query = select(CheckRow).order_by(CheckRow.created_at.desc(), CheckRow.id).limit(limit)
    with store.reading() as conn:
        return [_record(row) for row in conn.execute(query)]


def stored_check(store: EvidenceStore, check_id: str) -> CheckRecord | None:
    with store.reading() as conn:
        row = conn.execute(select(CheckRow).where(CheckRow.id == check_id)).first()
    return None if row is None else _record(row)
