"""The survey table: one row per op_db entry, stack, batching variant, dtype and torch version, with native's status
and the status inside ``registry.use()``.

The table is defined on ``registry.store.tables``' metadata beside the others (the migrations' ``env.py`` imports this
module so that Alembic compares it too); the schema itself is made by the migrations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Column, Float, Integer, String, Table, Text, UniqueConstraint, select

from registry.core.status import STATUSES
from registry.store.evidence_store import EvidenceStore
from registry.store.tables import METADATA, upsert

survey_results = Table(
    "survey_results",
    METADATA,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("torch_version", String(100), nullable=False),
    Column("op", String(200), nullable=False, index=True),  # op_db entry: name, or name.variant
    Column("opinfo_name", String(200), nullable=False),
    Column("variant_test_name", String(200), nullable=False),
    Column("stack", String(100), nullable=False),
    Column("batching", String(20), nullable=False),
    Column("dtype", String(50), nullable=False),
    Column("native_status", String(20), nullable=False),
    Column("native_detail", Text, nullable=False),
    Column("use_status", String(20), nullable=False),
    Column("use_detail", Text, nullable=False),
    Column("max_abs_error", Float, nullable=True),
    Column("max_rel_error", Float, nullable=True),
    Column("samples", Integer, nullable=False),
    Column("timestamp", String(40), nullable=False),  # ISO 8601, UTC
    UniqueConstraint("torch_version", "op", "stack", "batching", "dtype", name="uq_survey_key"),
)
_KEY = ("torch_version", "op", "stack", "batching", "dtype")
_COLUMNS = tuple(c.name for c in survey_results.columns if c.name != "id")


def _to_row(row: Any) -> dict[str, Any]:
    values = row.as_dict() if hasattr(row, "as_dict") else dict(row)
    for column in ("native_status", "use_status"):
        if values[column] not in STATUSES:
            raise ValueError(f"invalid {column} {values[column]!r} for survey row {values['op']}/{values['stack']}; "
                             f"valid: {', '.join(STATUSES)}")
    missing = [c for c in _COLUMNS if c not in values]
    if missing:
        raise ValueError(f"survey row {values.get('op')!r} lacks {', '.join(missing)}")
    return {c: values[c] for c in _COLUMNS}


def write_survey(store: EvidenceStore, rows: Iterable[Any]) -> int:
    """Upsert survey rows (SurveyRow objects or dicts) in one transaction; a later run replaces an earlier one's row
    with the same torch version, entry, stack, batching and dtype. Returns how many were given."""
    given = [_to_row(row) for row in rows]
    if not given:
        return 0
    unique = list({tuple(row[k] for k in _KEY): row for row in given}.values())
    with store.writing() as conn:
        upsert(conn, survey_results, unique, _KEY)
    return len(given)


def survey_rows(store: EvidenceStore, *, torch_version: str | None = None, op: str | None = None,
                stack: str | None = None) -> list[dict[str, Any]]:
    """Stored survey rows matching the filters, ordered by entry, stack, batching and dtype."""
    query = select(survey_results)
    for column, value in (("torch_version", torch_version), ("op", op), ("stack", stack)):
        if value is not None:
            query = query.where(survey_results.c[column] == value)
    query = query.order_by(survey_results.c.op, survey_results.c.stack, survey_results.c.batching,
                           survey_results.c.dtype)
    with store.reading() as conn:
        return [{c: row._mapping[c] for c in _COLUMNS} for row in conn.execute(query)]
