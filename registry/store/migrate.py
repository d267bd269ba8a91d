"""Schema migrations of the store (Alembic; the revisions are in ``registry/store/migrations/versions``).

``upgrade(url)`` brings a store to the newest revision (``multicomposite db upgrade``), ``current(url)`` says where
it stands (``multicomposite db current``). ``Store()`` calls ``ensure_current`` when it opens a store: a SQLite file
is upgraded there and then (one user, one file: nothing else could need the old schema), any server database is
refused with a one-line error saying to run ``multicomposite db upgrade`` (a shared server may still serve older
workers, and its schema changes when its operator says so, not when the first new process connects).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import NullPool

from registry.store.connection import SchemaError, sqlite_pragmas

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# Alembic keeps the running migration in module globals (``alembic.context``, ``alembic.op``): two threads of one
# process migrating at once would mix them up. Processes (and machines) are kept apart by the database's own locks.
_ALEMBIC = threading.Lock()
# Any constant: the key of the PostgreSQL advisory lock that queues migrations of one database (several machines
# running `multicomposite db upgrade` at once migrate it once; the others then find it at head).
MIGRATION_LOCK_KEY = 0x6D756C7469  # "multi"


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest revision: the schema this code reads and writes."""
    heads = _script().get_heads()
    if len(heads) != 1:  # two revisions with the same parent: a merge revision is missing
        raise SchemaError(f"the store's migrations have {len(heads)} heads ({', '.join(heads)}); expected one")
    return heads[0]


def revisions() -> list[str]:
    """Every known revision, oldest first."""
    return [script.revision for script in reversed(list(_script().walk_revisions()))]


def _sqlite_transactions(engine: Engine) -> None:
    """Make pysqlite run real transactions, DDL included: the driver's own mode commits before DDL and begins late.
    ``BEGIN IMMEDIATE`` takes the write lock first, so two processes migrating one file go one after the other."""
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver sends no BEGIN / COMMIT of its own
        sqlite_pragmas(dbapi_connection, record)

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


@contextmanager
def _migration_connection(url: str) -> Iterator[Connection]:
    engine = create_engine(url, poolclass=NullPool)
    if engine.dialect.name == "sqlite":
        _sqlite_transactions(engine)
    try:
        with engine.connect() as connection:
            yield connection
    finally:
        engine.dispose()


def current_of(connection: Connection) -> str | None:
    """The revision recorded in the store behind ``connection``; None when it has no version table (an empty
    database, or a store made before migrations)."""
    return MigrationContext.configure(connection).get_current_revision()


def current(url: str) -> str | None:
    """The revision the store at ``url`` is at (None: never migrated)."""
    with _migration_connection(url) as connection:
        revision = current_of(connection)
        connection.rollback()
    return revision


def _migrate(url: str, step: Callable[[Config, str], None], revision: str) -> tuple[str | None, str | None]:
    """Run Alembic's ``step`` (command.upgrade or command.downgrade) to ``revision`` on the store at ``url``, in one
    transaction; returns (revision before, revision after)."""
    with _migration_connection(url) as connection:
        before = current_of(connection)
        connection.rollback()
        with _ALEMBIC:
            step(_config(connection), revision)
        after = current_of(connection)
        connection.rollback()
    return before, after


def upgrade(url: str, revision: str = "head") -> tuple[str | None, str | None]:
    """Migrate the store at ``url`` to ``revision`` in one transaction; returns (revision before, revision after).
    A store made before migrations is adopted: its tables are kept, missing ones added (revision 0001)."""
    return _migrate(url, command.upgrade, revision)


def downgrade(url: str, revision: str) -> tuple[str | None, str | None]:
    """Migrate the store at ``url`` back to ``revision`` ("base": no tables); returns (before, after)."""
    return _migrate(url, command.downgrade, revision)


def ensure_current(engine: Engine, url: str, shown_url: str) -> None:
    """Called by ``Store()``: return when the store is at the head revision. Below it, upgrade a SQLite store here;
    refuse any other (SchemaError, one line saying what to run). A revision this code does not know means a newer
    multicomposite migrated the store: refuse, saying to update this one."""
    with engine.connect() as connection:
        revision = current_of(connection)
    newest = head()
    if revision == newest:
        return
    if revision is not None and revision not in revisions():
        raise SchemaError(f"the store at {shown_url} is at schema revision {revision}, which this multicomposite "
                          f"does not know (it knows up to {newest}): a newer version migrated it; update "
                          "multicomposite on this machine")
    if engine.dialect.name == "sqlite":
        if engine.url.database in (None, "", ":memory:"):
            # A private in-memory database: only this engine's connection sees it, so migrate through that.
            with engine.connect() as connection, _ALEMBIC:
                command.upgrade(_config(connection), "head")
        else:
            upgrade(url)
        return
    where = f"at schema revision {revision}" if revision is not None else "not migrated yet (no alembic_version)"
    raise SchemaError(f"the store at {shown_url} is {where}, this multicomposite needs {newest}; run "
                      "`multicomposite db upgrade` with MULTICOMPOSITE_DB set to this store, then start again")
