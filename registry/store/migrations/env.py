"""Alembic's entry point for the store's migrations. ``registry.store.migrate`` runs it with a connection in
``config.attributes["connection"]``; there is no alembic.ini and no offline (SQL script) mode."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

import registry.store.checks  # noqa: F401
import registry.store.conformance  # noqa: F401
import registry.store.evidence_store  # noqa: F401
import registry.store.job_store  # noqa: F401
import registry.store.survey  # noqa: F401
import registry.store.workers  # noqa: F401  (these define their tables on the same metadata)
from registry.store.migrate import MIGRATION_LOCK_KEY
from registry.store.tables import METADATA


def run_migrations(connection: Connection) -> None:
    # One transaction around every step: on PostgreSQL (transactional DDL) and on SQLite (registry.store.migrate
    # opens it with BEGIN IMMEDIATE) an upgrade that fails half-way leaves the schema as it was.
    with connection.begin():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.configure(connection=connection, target_metadata=METADATA,
                          render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("the store's migrations run online only: use `multicomposite db upgrade`")
connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("registry.store.migrate passes the connection; run `multicomposite db upgrade`")
run_migrations(connection)
