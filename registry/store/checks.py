"""The checks table: one row per ``registry.check`` report a check job stored (``records.CheckRecord``), and what is
read and written of it.

Defined on ``registry.store.tables``' metadata beside the others (the migrations' ``env.py`` imports this module so
that Alembic compares it too); revision 0006 adds it to an existing store.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sqlalchemy import select

from registry.store.evidence_store import EvidenceStore
from registry.store.records import CheckRecord
from registry.store.tables import METADATA, json_fields, record_table

checks_table = record_table("checks", CheckRecord, METADATA)
_JSON = json_fields(CheckRecord)  # report
_FIELDS = tuple(spec.name for spec in dataclasses.fields(CheckRecord))


def _row(record: CheckRecord) -> dict[str, Any]:
    values = dataclasses.asdict(record)
    return {name: json.dumps(values[name]) if name in _JSON else values[name] for name in _FIELDS}


def _record(row: Any) -> CheckRecord:
    values = dict(row._mapping)
    return CheckRecord(**{name: json.loads(values[name]) if name in _JSON else values[name] for name in _FIELDS})


def write_check(store: EvidenceStore, record: CheckRecord) -> None:
    """Store one check; a check of the same id (its job, run again) is replaced."""
    with store.writing() as conn:
        conn.execute(checks_table.delete().where(checks_table.c.id == record.id))
        conn.execute(checks_table.insert().values(**_row(record)))


def stored_checks(store: EvidenceStore, *, limit: int = 100) -> list[CheckRecord]:
    """The newest checks first, at most ``limit``."""
    query = select(checks_table).order_by(checks_table.c.created_at.desc(), checks_table.c.id).limit(limit)
    with store.reading() as conn:
        return [_record(row) for row in conn.execute(query)]


def stored_check(store: EvidenceStore, check_id: str) -> CheckRecord | None:
    with store.reading() as conn:
        row = conn.execute(select(checks_table).where(checks_table.c.id == check_id)).first()
    return None if row is None else _record(row)
