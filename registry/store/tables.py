"""The store's table layer: the one ``METADATA`` every table is defined on (the migrations compare it with the
database), a record's table built from its declaration (``records.stored``), the store-wide ``store_meta`` table,
and the upsert the evidence tables are written with."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    bindparam,
)
from sqlalchemy.dialects import postgresql, sqlite

from registry.core.stacks import format_stack

METADATA = MetaData()


def record_table(name: str, record: type, metadata: MetaData, key: tuple[str, ...] = (), constraint: str = ""
                 ) -> Table:
    """The table of a record (``records.stored`` says how each field is stored): one column per field, an ``id``
    primary key unless a field is the primary key, and a unique constraint on ``key`` when given."""
    hints = typing.get_type_hints(record)
    specs = dataclasses.fields(record)
    columns = [] if any(spec.metadata["primary"] for spec in specs) else [
        Column("id", Integer, primary_key=True, autoincrement=True)]
    for spec in specs:
        stored, hint = spec.metadata, hints[spec.name]
        nullable = type(None) in typing.get_args(hint)
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if nullable else hint
        base = typing.get_origin(base) or base
        if base in (str, tuple):  # a stack is stored as its spelling
            column_type: Any = String(stored["limit"]) if stored["limit"] else Text
        elif base is dict:  # JSON
            column_type = Text
        elif base is float:
            column_type = Float
        elif base in (int, bool):  # a bool as 0 or 1
            column_type = BigInteger if stored["wide"] else Integer
        else:
            raise TypeError(f"{record.__name__}.{spec.name}: no column type for {hint}; use str, a tuple of str, "
                            "int, float, bool or dict")
        columns.append(Column(spec.name, column_type, nullable=nullable, index=stored["index"] or None,
                              primary_key=stored["primary"]))
    return Table(name, metadata, *columns, *([UniqueConstraint(*key, name=constraint)] if key else []))


def json_fields(record: type) -> tuple[str, ...]:
    """The record's ``dict`` fields (optional or not): stored as JSON text."""
    def is_dict(hint: Any) -> bool:
        return (typing.get_origin(hint) or hint) is dict

    return tuple(name for name, hint in typing.get_type_hints(record).items()
                 if is_dict(hint) or any(is_dict(arg) for arg in typing.get_args(hint)))


# One row per key. ``generation`` counts the writes of evidence (matrix, profiles): a reader compares it with the
# value it last loaded at, one indexed read, instead of reloading the tables to see whether anything changed. A
# store's readiness check reads it too (``database.Database.check``).
meta_table = Table(
    "store_meta",
    METADATA,
    Column("key", String(100), primary_key=True),
    Column("value", BigInteger, nullable=False),
)
GENERATION = "generation"
# The schema's version is Alembic's (the alembic_version table; registry/store/migrations). Before migrations it was
# a "schema_version" row here: 2 when stacks were stored in the one spelling, vmap(grad) (1 wrote vmap,grad).


def upsert(conn: Connection, table: Table, rows: list[dict[str, Any]], key: tuple[str, ...]) -> None:
    """Insert ``rows`` (unique by ``key`` among themselves), each replacing the stored row with the same ``key``.

    SQLite and PostgreSQL get ``INSERT ... ON CONFLICT (key) DO UPDATE``: one statement per row that either inserts or
    updates, atomic on PostgreSQL even against a concurrent writer of the same key (a delete-then-insert there lets
    two transactions both find nothing to delete, and the second insert fails on the unique key). Rows go in key
    order, so concurrent writers lock shared keys in the same order and cannot deadlock on them. Other backends get
    the portable delete-then-insert.
    """
    rows = sorted(rows, key=lambda row: tuple(row[name] for name in key))
    dialect = conn.dialect.name
    if dialect in ("postgresql", "sqlite"):
        insert = (postgresql if dialect == "postgresql" else sqlite).insert(table)
        replaced = {column.name: insert.excluded[column.name] for column in table.columns
                    if column.name not in key and not column.primary_key}
        conn.execute(insert.on_conflict_do_update(index_elements=list(key), set_=replaced), rows)
        return
    key_match = and_(*(table.c[name] == bindparam(f"k_{name}") for name in key))
    conn.execute(table.delete().where(key_match), [{f"k_{name}": row[name] for name in key} for row in rows])
    conn.execute(table.insert(), rows)


def encode_stack(stack: tuple[str, ...]) -> str:
    """A stack as stored: its one spelling, vmap(grad); a name that could not be told apart after joining raises."""
    for name in stack:
        if not name or any(mark in name for mark in ",()"):
            raise ValueError(f"invalid transform name in stack {stack!r}: {name!r}")
    return format_stack(stack)
