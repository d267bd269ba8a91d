"""Persistence for the compatibility matrix: one row per op, composite, stack, pattern, dtype, device, torch version."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import socket
import sqlite3
import threading
import time
import typing
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
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
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row, make_url
from sqlalchemy.exc import OperationalError

from registry.core.messages import first_line
from registry.core.stacks import format_stack
from registry.core.status import STATUSES
from registry.store.connection import (
    BUSY_TIMEOUT_MS,
    StoreUnavailableError,
    default_url,
    sqlite_pragmas,
)
from registry.store.job_states import ACTIVE_JOB_STATES, FINISHED_JOB_STATES
from registry.store.job_states import JOB_STATES as JOB_STATES  # the store's users read it here too
from registry.store.records import (
    MATRIX_KEY,
    PROFILE_KEY,
    JobRecord,
    MatrixEntry,
    ProfileEntry,
    matrix_entry_from_mapping,
    of_current_sources,
    profile_from_mapping,
)

CHECK_TIMEOUT_S = 5.0  # a readiness check waits this long for a lock, not a writer's 30 s


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


METADATA = MetaData()
_matrix = record_table("matrix_entries", MatrixEntry, METADATA, MATRIX_KEY, "uq_matrix_key")
_profiles = record_table("profiles", ProfileEntry, METADATA, PROFILE_KEY, "uq_profile_key")


# One row per key. ``generation`` counts the writes of evidence (matrix, profiles): a reader compares it with the
# value it last loaded at, one indexed read, instead of reloading the tables to see whether anything changed.
_meta = Table(
    "store_meta",
    METADATA,
    Column("key", String(100), primary_key=True),
    Column("value", BigInteger, nullable=False),
)
GENERATION = "generation"
# The schema's version is Alembic's (the alembic_version table; registry/store/migrations). Before migrations it was
# a "schema_version" row here: 2 when stacks were stored in the one spelling, vmap(grad) (1 wrote vmap,grad).

jobs_table = record_table("jobs", JobRecord, METADATA)


def json_fields(record: type) -> tuple[str, ...]:
    """The record's ``dict`` fields (optional or not): stored as JSON text."""
    def is_dict(hint: Any) -> bool:
        return (typing.get_origin(hint) or hint) is dict

    return tuple(name for name, hint in typing.get_type_hints(record).items()
                 if is_dict(hint) or any(is_dict(arg) for arg in typing.get_args(hint)))


_JOB_JSON = json_fields(JobRecord)  # params, result

# Benchmarking runs (profile, verify), so that a profile can tell whether another process ran while it timed.
_runs = Table(
    "bench_runs",
    METADATA,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("kind", String(50), nullable=False),
    Column("host", String(300), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
)


@dataclass(frozen=True)
class BenchRun:
    id: int
    kind: str
    host: str
    pid: int
    started_at: float
    finished_at: float | None


def this_process() -> str:
    """``host:pid``: who owns a job."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_alive(owner: str) -> bool:
    """Whether the ``host:pid`` process still runs; a process on another host is taken as alive (cannot tell)."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def safe_url(url: str) -> str:
    """``url`` with its password masked (``***``): what messages and logs may show of a server URL."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: nothing in it to hide that we could find
        return url


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


def _encode_stack(stack: tuple[str, ...]) -> str:
    for name in stack:
        # A separator or an empty name could not be told apart after joining.
        if not name or any(mark in name for mark in ",()"):
            raise ValueError(f"invalid transform name in stack {stack!r}: {name!r}")
    return format_stack(stack)


def data_dir(url: str) -> Path:
    """The folder beside a SQLite store, else the user data dir: where the benchmark lock lives."""
    if url.startswith("sqlite:///") and url.removeprefix("sqlite:///") not in ("", ":memory:"):
        return Path(url.removeprefix("sqlite:///")).parent
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    folder = Path(base) / "multicomposite"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _job_row(job: JobRecord) -> dict[str, Any]:
    values = vars(job).copy()
    for name in _JOB_JSON:
        values[name] = json.dumps(values[name]) if values[name] is not None else None
    return values


def job_from_row(row: Row[Any]) -> JobRecord:
    values = dict(row._mapping)
    for name in _JOB_JSON:
        values[name] = json.loads(values[name]) if values[name] is not None else None
    return JobRecord(**values)


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
        "measured_at": entry.measured_at,
    }


def _from_row(row: Row[Any]) -> MatrixEntry:
    return matrix_entry_from_mapping(row._mapping)


def _profile_from_row(row: Row[Any]) -> ProfileEntry:
    return profile_from_mapping(row._mapping)


class Store:
    """The compatibility matrix in a SQL database (SQLite by default)."""

    def __init__(self, url: str | None = None, *, create: bool = True, timeout_s: float | None = None) -> None:
        """Open the store at ``url``. With ``create``, check its schema revision (once, when a process opens it: a
        server does it in its lifespan, never per request): a SQLite file is created or migrated to the newest
        revision here; a server database below it raises SchemaError saying to run ``multicomposite db upgrade``
        (see registry/store/migrate.py for why).

        ``timeout_s`` bounds every wait of a reader that must not hang (the library's evidence read): SQLite's
        busy timeout; PostgreSQL's connect timeout (the whole handshake: a server that accepts and never answers),
        its statement timeout, and the TCP user timeout (a network that drops packets). Without it a writer waits
        ``BUSY_TIMEOUT_MS`` for SQLite's lock and 10 s for a server to answer a connect."""
        self.url = url if url is not None else default_url()
        self.display_url = safe_url(self.url)  # for messages: never the password
        options: dict[str, Any] = {}
        if not self.url.startswith("sqlite"):
            # A server restarts, or ends idle connections: test each pooled connection before handing it out, so
            # the first request after a restart gets a new one instead of an error.
            options["pool_pre_ping"] = True
            query = make_url(self.url).query
            connect_args: dict[str, Any] = {}
            if "connect_timeout" not in query:
                # A server that is down: fail in seconds (libpq counts whole seconds, at least 2).
                connect_args["connect_timeout"] = 10 if timeout_s is None else max(2, math.ceil(timeout_s))
            if timeout_s is not None:
                milliseconds = max(1, int(timeout_s * 1000))
                if "options" not in query:
                    connect_args["options"] = f"-c statement_timeout={milliseconds}"
                if "tcp_user_timeout" not in query:
                    connect_args["tcp_user_timeout"] = milliseconds
                options["pool_timeout"] = timeout_s
            if connect_args:
                options["connect_args"] = connect_args
        elif timeout_s is not None:
            options["connect_args"] = {"timeout": timeout_s}
        self.engine: Engine = create_engine(self.url, **options)
        self._sqlite = self.engine.dialect.name == "sqlite"
        if self._sqlite:
            busy_ms = BUSY_TIMEOUT_MS if timeout_s is None else max(1, int(timeout_s * 1000))
            event.listen(self.engine, "connect", functools.partial(sqlite_pragmas, busy_timeout_ms=busy_ms))
        if create:
            from registry.store.migrate import ensure_current

            try:
                ensure_current(self.engine, self.url, self.display_url)
            except BaseException:
                self.engine.dispose()  # a store that cannot be opened keeps no connection (nor its file) open
                raise
        self._replacing = threading.Lock()
        self._file_id = self._sqlite_file_id()

    @staticmethod
    def _bump(conn: Any) -> None:
        """Count one write of evidence. Called first in a writing transaction: on PostgreSQL the row lock it takes
        queues evidence writers one after another (as SQLite's one writer does), so their upserts never deadlock,
        and the counter, read and incremented under that lock, counts every write."""
        conn.execute(update(_meta).where(_meta.c.key == GENERATION).values(value=_meta.c.value + 1))

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        """A connection for reads; a lost or refused connection becomes StoreUnavailableError saying so."""
        try:
            with self.engine.connect() as conn:
                yield conn
        except OperationalError as error:
            raise StoreUnavailableError(f"the store at {self.display_url} cannot be read: {type(error).__name__}: "
                                        f"{first_line(error)}") from error

    @contextmanager
    def _writing(self) -> Iterator[Connection]:
        """One transaction, committed when the block ends. A lost or refused connection (a server killed or
        restarted, a backend terminated, SQLite's file locked past the timeout) becomes StoreUnavailableError:
        before the commit, the transaction was rolled back by the database and nothing of it is stored; during the
        commit, whether it was stored cannot be known from here. A SQLite file deleted or replaced since this
        process opened it refuses the write (``_same_file``)."""
        self._same_file()
        stage = "write"
        try:
            with self.engine.connect() as conn, conn.begin():
                yield conn
                stage = "commit"
        except OperationalError as error:
            cause = f"{type(error).__name__}: {first_line(error)}"
            if stage == "commit":
                raise StoreUnavailableError(f"the store at {self.display_url} failed while committing a write "
                                            f"({cause}); whether it was stored is unknown, read it back once the "
                                            "store answers again") from error
            raise StoreUnavailableError(f"the store at {self.display_url} failed during a write ({cause}); it was "
                                        "rolled back, nothing of it is stored; retry once the store answers "
                                        "again") from error

    def generation(self) -> int:
        """How many times evidence was written: compare it with a remembered value to see whether to reload."""
        with self._reading() as conn:
            value = conn.execute(select(_meta.c.value).where(_meta.c.key == GENERATION)).scalar()
        return int(value or 0)

    def data_dir(self) -> Path:
        return data_dir(self.url)

    def check(self) -> None:
        """Raise StoreUnavailableError saying why, unless the store answers a query.

        A SQLite file is checked through SQLite only, never opened by this process directly: closing any descriptor
        of a file drops every POSIX lock the process holds on it, SQLite's included, and another process closing its
        connection then takes itself for the last one and deletes the ``-wal`` and ``-shm`` files this process still
        writes into (https://www.sqlite.org/howtocorrupt.html, 2.2). SQLite's own connections share one descriptor
        per file in a process and keep it open while any of them holds a lock.
        """
        if self._sqlite:
            self._check_sqlite_file()
        try:
            self.generation()
        except StoreUnavailableError:
            raise
        except Exception as error:  # any driver error is the answer
            raise StoreUnavailableError(f"the store at {self.display_url} cannot be read: {type(error).__name__}: "
                                        f"{first_line(error)}") from error

    def _sqlite_path(self) -> str | None:
        """The SQLite file's path, or None (a server store, an in-memory one, a ``file:`` URI)."""
        if not self._sqlite:
            return None
        path = self.engine.url.database or ""
        return None if path in ("", ":memory:") or path.startswith("file:") else path

    def _sqlite_file_id(self) -> tuple[int, int] | None:
        """The SQLite file's device and inode (a stat: it opens nothing), or None when there is none."""
        path = self._sqlite_path()
        if path is None:
            return None
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

    def _same_file(self) -> None:
        """Raise StoreUnavailableError when the SQLite file at the path is not the one this process opened (a stat):
        a pooled connection would write into the deleted or moved file, which no other process reads, and the write
        would be lost. The service's check (``_check_sqlite_file``) reopens a replaced file; a command runs again."""
        with self._replacing:
            opened = self._file_id
        if opened is None:
            return
        now = self._sqlite_file_id()
        if now == opened:
            return
        what = "does not exist any more" if now is None else "was replaced by another file"
        raise StoreUnavailableError(f"the store file {self._sqlite_path()} {what} since this process opened it; "
                                    "nothing of this write is stored; put the file back, or run again to write the "
                                    "one there now")

    def _check_sqlite_file(self) -> None:
        """The file is there and is a SQLite database, read fresh: a pooled connection in WAL mode answers from its
        cache after the file was overwritten, so a new connection (``mode=rw``: it never creates a missing file)
        reads the generation from the file itself. A file replaced since the last check (restored from a backup,
        deleted and recreated) is reopened first (``_reopen_replaced``)."""
        path = self._sqlite_path()
        if path is None:
            return
        file_id = self._sqlite_file_id()
        if file_id is None:
            if not os.path.exists(path):
                raise StoreUnavailableError(f"the store file {path} does not exist")
            raise StoreUnavailableError(f"the store file {path} cannot be read (check its permissions)")
        with self._replacing:
            if self._file_id is not None and file_id != self._file_id:
                self._reopen_replaced()
            self._file_id = file_id
        try:
            fresh = sqlite3.connect(f"file:{quote(path)}?mode=rw", uri=True, timeout=CHECK_TIMEOUT_S)
        except sqlite3.Error as error:
            raise StoreUnavailableError(f"the store file {path} cannot be opened: {error}") from None
        try:
            fresh.execute("SELECT value FROM store_meta WHERE key = ?", (GENERATION,)).fetchall()
        except sqlite3.Error as error:
            if getattr(error, "sqlite_errorname", "") == "SQLITE_NOTADB":
                raise StoreUnavailableError(f"the store file {path} is not a SQLite database (bad header)") from None
            raise StoreUnavailableError(f"the store at {self.display_url} cannot be read: {type(error).__name__}: "
                                        f"{first_line(error)}") from None
        finally:
            fresh.close()

    def _reopen_replaced(self) -> None:
        """The file at the path is another one now; pooled connections still read the old one. The -wal beside it
        still holds the old file's pages, and SQLite closing a moved file leaves them there: the new file would
        read them as its own. So an idle pooled connection of the old file first moves them into that file and
        empties the -wal (``wal_checkpoint(TRUNCATE)``), then the pool closes. Only an idle one: a new connection
        would open the new file. Best effort: what SQLite can still save of a file replaced under it is saved."""
        if self.engine.pool.checkedin() > 0:  # type: ignore[attr-defined]
            try:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            except Exception:  # the old file is beyond saving; the new one is what counts now
                pass
        self.engine.dispose()

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
        rows = list({tuple(row[name] for name in MATRIX_KEY): row for row in given}.values())
        with self._writing() as conn:
            self._bump(conn)
            upsert(conn, _matrix, rows, MATRIX_KEY)
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
        with self._reading() as conn:
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
        with self._reading() as conn:
            rows = [_from_row(row) for row in conn.execute(query)]
        return of_current_sources(rows, source_hashes)

    def write_profiles(self, profiles: Iterable[ProfileEntry]) -> int:
        """Upsert ``profiles`` in one transaction (an interrupted run leaves earlier results intact)."""
        rows = [{**vars(p), "stack": _encode_stack(tuple(p.stack)), "valid": int(p.valid)} for p in profiles]
        if not rows:
            return 0
        unique = list({tuple(row[name] for name in PROFILE_KEY): row for row in rows}.values())
        with self._writing() as conn:
            self._bump(conn)
            upsert(conn, _profiles, unique, PROFILE_KEY)
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
        with self._reading() as conn:
            return [_profile_from_row(row) for row in conn.execute(query)]

    def profile_devices(self) -> list[str]:
        """The device types stored timings name (one indexed scan, no rows built)."""
        with self._reading() as conn:
            return sorted(row[0] for row in conn.execute(select(_profiles.c.device).distinct()))

    def fresh_profiles(self, *, source_hashes: Mapping[tuple[str, str], str], torch_version: str,
                       op: str | None = None) -> list[ProfileEntry]:
        """Timings still valid for these composite sources and this torch."""
        return of_current_sources((p for p in self.profiles(op=op) if p.torch_version == torch_version), source_hashes)

    def clear(self) -> None:
        """Delete every row."""
        with self._writing() as conn:
            self._bump(conn)
            conn.execute(_matrix.delete())
            conn.execute(_profiles.delete())

    # Jobs ------------------------------------------------------------------------------------------------------

    def add_job(self, job: JobRecord) -> None:
        with self._writing() as conn:
            conn.execute(jobs_table.insert(), [_job_row(job)])

    def update_job(self, job_id: str, *, if_state: Iterable[str] | None = None, if_owner: str | None = None,
                   **values: Any) -> bool:
        """Write ``values`` into job ``job_id``'s row, only while its state is one of ``if_state`` and its owner is
        ``if_owner`` when given (a worker writes only the jobs it still runs); whether a row was written."""
        for name in _JOB_JSON:
            if values.get(name) is not None:
                values[name] = json.dumps(values[name])
        values["updated_at"] = time.time()
        query = update(jobs_table).where(jobs_table.c.id == job_id)
        if if_state is not None:
            query = query.where(jobs_table.c.state.in_(list(if_state)))
        if if_owner is not None:
            query = query.where(jobs_table.c.owner == if_owner)
        with self._writing() as conn:
            return bool(conn.execute(query.values(**values)).rowcount)

    def claim_job(self, job_id: str, owner: str) -> JobRecord | None:
        """``queued`` -> ``running`` for ``owner``, its count reset, in one statement: of workers fetching the same
        job (a job queued twice), one claims it; the job as claimed, or None if it was not queued (cancelled,
        finished, or taken)."""
        now = time.time()
        with self._writing() as conn:
            row = conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "queued")
                               .values(state="running", owner=owner, started_at=now, updated_at=now, done=0, total=0)
                               .returning(*jobs_table.c)).first()
        return job_from_row(row) if row is not None else None

    def start_job(self, job_id: str, owner: str) -> JobRecord | None:
        """``queued`` -> ``running`` for ``owner``, in one statement (a cancel cannot slip in between the check and
        the write); the job as started, or None if it was not queued (cancelled, deleted, taken). A job ``owner``
        runs already counts as started: a retry after a commit whose outcome was unknown."""
        now = time.time()
        with self._writing() as conn:
            mine = and_(jobs_table.c.state == "running", jobs_table.c.owner == owner)
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "queued")
                         .values(state="running", owner=owner, started_at=now, updated_at=now))
            row = conn.execute(select(jobs_table).where(jobs_table.c.id == job_id, mine)).first()
        return job_from_row(row) if row is not None else None

    def cancel_job(self, job_id: str) -> JobRecord | None:
        """Cancel ``job_id``: a queued one at once (one statement: a runner cannot start it in between), a running
        one is marked ``cancelling`` and its runner stops it at the next case boundary. Returns the job as it is
        now (None if there is none); a finished one is unchanged."""
        now = time.time()
        with self._writing() as conn:
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "queued")
                         .values(state="cancelled", error="cancelled before it started", finished_at=now,
                                 updated_at=now))
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "running")
                         .values(state="cancelling", updated_at=now))
        return self.job(job_id)

    def job(self, job_id: str) -> JobRecord | None:
        with self._reading() as conn:
            row = conn.execute(select(jobs_table).where(jobs_table.c.id == job_id)).first()
        return job_from_row(row) if row is not None else None

    def jobs(self, *, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Jobs, oldest first, optionally only in ``states``."""
        query = select(jobs_table).order_by(jobs_table.c.created_at, jobs_table.c.id)
        if states is not None:
            query = query.where(jobs_table.c.state.in_(list(states)))
        with self._reading() as conn:
            return [job_from_row(row) for row in conn.execute(query)]

    def job_counts(self) -> dict[str, int]:
        from sqlalchemy import func

        with self._reading() as conn:
            return {state: count for state, count in
                    conn.execute(select(jobs_table.c.state, func.count()).group_by(jobs_table.c.state))}

    def recover_jobs(self, owner: str) -> tuple[list[str], list[JobRecord]]:
        """After a restart: jobs left ``running`` by a process that is gone become ``interrupted`` (with the reason),
        ``cancelling`` ones ``cancelled``; ``queued`` jobs of a gone process pass to ``owner``. Returns (interrupted
        ids, queued jobs to run)."""
        now = time.time()
        interrupted, adopted = [], []
        with self._writing() as conn:
            # FOR UPDATE (PostgreSQL): two servers recovering at once do not both adopt a job.
            pending = select(jobs_table).where(jobs_table.c.state.in_(("queued", *ACTIVE_JOB_STATES))).with_for_update()
            for row in conn.execute(pending).all():
                job = job_from_row(row)
                if job.owner == owner or process_alive(job.owner):
                    continue
                if job.state == "cancelling":  # asked to stop, and it did: with its process
                    conn.execute(update(jobs_table).where(jobs_table.c.id == job.id).values(
                        state="cancelled", error=f"cancelled while running, at {job.done}/{job.total}",
                        finished_at=now, updated_at=now))
                elif job.state == "running":
                    reason = (f"interrupted: the server running it ({job.owner}) stopped before it finished, at "
                              f"{job.done}/{job.total}; submit it again")
                    conn.execute(update(jobs_table).where(jobs_table.c.id == job.id).values(
                        state="interrupted", error=reason, finished_at=now, updated_at=now))
                    interrupted.append(job.id)
                else:
                    conn.execute(update(jobs_table).where(jobs_table.c.id == job.id)
                                 .values(owner=owner, updated_at=now))
                    job.owner = owner
                    adopted.append(job)
        return interrupted, adopted

    def prune_jobs(self, finished_before: float) -> int:
        """Delete finished jobs (done, failed, cancelled, interrupted) that finished before ``finished_before``."""
        with self._writing() as conn:
            result = conn.execute(jobs_table.delete().where(jobs_table.c.state.in_(FINISHED_JOB_STATES),
                                                       jobs_table.c.finished_at < finished_before))
        return result.rowcount or 0

    # Benchmarking runs -----------------------------------------------------------------------------------------

    def begin_run(self, kind: str) -> int:
        with self._writing() as conn:
            result = conn.execute(_runs.insert(), [{"kind": kind, "host": socket.gethostname(), "pid": os.getpid(),
                                                    "started_at": time.time(), "finished_at": None}])
            return int(result.inserted_primary_key[0])

    def end_run(self, run_id: int) -> None:
        with self._writing() as conn:
            conn.execute(update(_runs).where(_runs.c.id == run_id).values(finished_at=time.time()))

    def overlapping_runs(self, run_id: int) -> list[BenchRun]:
        """Other runs whose time overlapped run ``run_id`` (an unfinished one counts while its process lives)."""
        with self._reading() as conn:
            mine = conn.execute(select(_runs).where(_runs.c.id == run_id)).one()
            end = mine.finished_at if mine.finished_at is not None else time.time()
            rows = conn.execute(select(_runs).where(_runs.c.id != run_id, _runs.c.started_at < end)).all()
        overlapping = []
        for row in rows:
            run = BenchRun(**dict(row._mapping))
            if run.finished_at is None and not process_alive(f"{run.host}:{run.pid}"):
                continue  # killed before it finished: it is not running now, and when it ran is unknown
            if run.finished_at is None or run.finished_at > mine.started_at:
                overlapping.append(run)
        return overlapping

    def integrity_ok(self) -> bool:
        """SQLite's ``PRAGMA integrity_check`` answered "ok"; always True for other backends."""
        if not self._sqlite:
            return True
        with self._reading() as conn:
            answers = [str(row[0]) for row in conn.execute(text("PRAGMA integrity_check"))]
        return answers == ["ok"]

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()
