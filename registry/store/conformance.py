"""The conformance table: one row per covered op, op_db entry, check, dtype and torch version, with how many cases
passed natively and inside ``registry.use()`` (``registry.harness.conformance``).

Defined on ``registry.store.tables``' metadata like the survey's table (the migrations' ``env.py`` imports this
module); revision 0004 adds it to an existing store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Column, Integer, String, Table, Text, UniqueConstraint, select

from registry.store.evidence_store import EvidenceStore
from registry.store.tables import METADATA, upsert

COUNTS = ("cases", "native_passed", "use_passed", "newly_passing", "newly_failing", "degenerate_cases")

conformance_results = Table(
    "conformance_results",
    METADATA,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("torch_version", String(100), nullable=False),
    Column("op", String(200), nullable=False, index=True),  # the covered op
    Column("entry", String(200), nullable=False),  # its op_db entry: name, or name.variant
    Column("check", String(50), nullable=False),
    Column("dtype", String(50), nullable=False),
    *(Column(name, Integer, nullable=False) for name in COUNTS),
    Column("detail", Text, nullable=False),
    Column("timestamp", String(40), nullable=False),  # ISO 8601, UTC
    UniqueConstraint("torch_version", "op", "entry", "check", "dtype", name="uq_conformance_key"),
)
_KEY = ("torch_version", "op", "entry", "check", "dtype")
_COLUMNS = tuple(c.name for c in conformance_results.columns if c.name != "id")


def _to_row(row: Any) -> dict[str, Any]:
    values = row.as_dict() if hasattr(row, "as_dict") else dict(row)
    missing = [c for c in _COLUMNS if c not in values]
    if missing:
        raise ValueError(f"conformance row {values.get('entry')!r} lacks {', '.join(missing)}")
    negative = [c for c in COUNTS if not isinstance(values[c], int) or values[c] < 0]
    if negative:
        raise ValueError(f"conformance row {values['entry']}/{values['check']}: {', '.join(negative)} must be "
                         "counts (integers >= 0)")
    return {c: values[c] for c in _COLUMNS}


def write_conformance(store: EvidenceStore, rows: Iterable[Any]) -> int:
    """Upsert conformance rows (ConformanceRow objects or dicts) in one transaction; a later run replaces an earlier
    one's row with the same torch version, op, entry, check and dtype. Returns how many were given."""
    given = [_to_row(row) for row in rows]
    if not given:
        return 0
    unique = list({tuple(row[k] for k in _KEY): row for row in given}.values())
    with store.writing() as conn:
        upsert(conn, conformance_results, unique, _KEY)
    return len(given)


def conformance_rows(store: EvidenceStore, *, torch_version: str | None = None,
                     op: str | None = None) -> list[dict[str, Any]]:
    """Stored conformance rows matching the filters, ordered by op, entry, check and dtype."""
    query = select(conformance_results)
    for column, value in (("torch_version", torch_version), ("op", op)):
        if value is not None:
            query = query.where(conformance_results.c[column] == value)
    query = query.order_by(conformance_results.c.op, conformance_results.c.entry, conformance_results.c.check,
                           conformance_results.c.dtype)
    with store.reading() as conn:
        return [{c: row._mapping[c] for c in _COLUMNS} for row in conn.execute(query)]
