"""The store's table layer: the declarative base whose one ``METADATA`` every table is defined on (the migrations
compare it with the database), a record's mapped class made from its declaration (``records.stored``), the
store-wide ``store_meta`` table, and the upsert the evidence tables are written with."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Dialect,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    and_,
    bindparam,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, mapped_column

from registry.core.stacks import format_stack

METADATA = MetaData()


class Base(DeclarativeBase):
    """The store's declarative base: every record's mapped class, on the one ``METADATA``."""

    metadata = METADATA


class JSONText(TypeDecorator[Any]):
    """A ``dict`` field: stored as JSON text (TEXT in the schema, as it always was), read back as the dict."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else json.dumps(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


def _column_type(record: type, name: str, hint: Any, stored: typing.Mapping[str, Any]) -> Any:
    """The column type of field ``name`` (type hint ``hint``, with or without ``| None``)."""
    base = next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint) \
        if type(None) in typing.get_args(hint) else hint
    base = typing.get_origin(base) or base
    if base in (str, tuple):  # a stack is stored as its spelling
        return String(stored["limit"]) if stored["limit"] else Text
    if base is dict:
        return JSONText
    if base is float:
        return Float
    if base in (int, bool):  # a bool as 0 or 1
        return BigInteger if stored["wide"] else Integer
    raise TypeError(f"{record.__name__}.{name}: no column type for {hint}; use str, a tuple of str, int, float, bool "
                    "or dict")


def mapped_record(record: type, table: str, key: tuple[str, ...] = (), constraint: str = "") -> type[Base]:
    """The declarative class of a record, ``<Record>Row`` on ``table``, made from its dataclass fields (``records.
    stored`` says how each is stored): one ``mapped_column`` per field in field order, an ``id`` primary key first
    unless a field is the primary key, and a unique constraint ``constraint`` on ``key`` when given. The record's
    fields are its only declaration; the stores query through the class (``select(Row).where(Row.op == op)``)."""
    hints = typing.get_type_hints(record)
    specs = dataclasses.fields(record)
    namespace: dict[str, Any] = {"__tablename__": table,
                                 "__doc__": f"The ``{table}`` table: one ``{record.__name__}`` per row."}
    if key:
        namespace["__table_args__"] = (UniqueConstraint(*key, name=constraint),)
    if not any(spec.metadata["primary"] for spec in specs):
        namespace["id"] = mapped_column(Integer, primary_key=True, autoincrement=True)
    for spec in specs:
        if spec.name in namespace or hasattr(Base, spec.name):  # id, metadata, registry, ...
            raise TypeError(f"{record.__name__}.{spec.name}: the name is taken on a declarative class (or the table's "
                            "own id); rename the field or make it the primary key")
        stored, hint = spec.metadata, hints[spec.name]
        column_type = _column_type(record, spec.name, hint, stored)
        numbered = stored["primary"] and column_type in (Integer, BigInteger)  # the database numbers the rows
        namespace[spec.name] = mapped_column(
            column_type, nullable=type(None) in typing.get_args(hint), index=stored["index"] or None,
            primary_key=stored["primary"], autoincrement=True if numbered else "auto")
    return type(f"{record.__name__}Row", (Base,), namespace)


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
