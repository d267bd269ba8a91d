"""Schema migrations (Alembic): a store made before migrations upgrades in place, a fresh one matches the models,
revisions go down and up again, upgrades running at once migrate once, and a store of another revision is refused
(a server database) or upgraded (a SQLite file) when opened. Every test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, make_url, text

from registry.store import migrate
from registry.store.connection import SchemaError
from registry.store.database import safe_url
from registry.store.db import Store
from registry.store.migrate import MIGRATION_LOCK_KEY
from registry.store.records import ProfileEntry
from registry.store.tables import METADATA
from service.cli import main
from tests.registry.store.test_store import entry

LEGACY_DDL = (Path(__file__).parent / "data" / "schema_before_migrations.sql").read_text()
HEAD = "0006"
TABLES = {"matrix_entries", "profiles", "store_meta", "jobs", "bench_runs", "survey_results", "conformance_results",
          "workers", "checks"}


def _execute(url: str, *statements: str) -> list[tuple[object, ...]]:
    """Run statements in one transaction; the rows of the last."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            rows: list[tuple[object, ...]] = []
            for statement in statements:
                result = conn.execute(text(statement))
                rows = [tuple(row) for row in result] if result.returns_rows else []
            return rows
    finally:
        engine.dispose()


def _legacy_ddl(url: str) -> list[str]:
    """The DDL of a store made before migrations; on PostgreSQL with SERIAL ids (what create_all made there)."""
    body = "\n".join(line for line in LEGACY_DDL.splitlines() if not line.startswith("--"))
    statements = [statement.strip() for statement in body.split(";") if statement.strip()]
    if url.startswith("postgresql"):
        statements = [statement.replace("id INTEGER NOT NULL", "id SERIAL NOT NULL") for statement in statements]
    return statements


LEGACY_ROWS = (
    "INSERT INTO store_meta (key, value) VALUES ('generation', 7), ('schema_version', 1)",
    # As schema 1 spelled stacks: vmap,grad.
    "INSERT INTO matrix_entries (op, composite, kind, stack, pattern, dtype, status, detail, max_abs_error, "
    "max_rel_error, source_hash, torch_version, device) VALUES ('index_fill', 'masked_where', 'functional', "
    "'vmap,grad', 'self', 'float32', 'ok', '', 1.5e-7, 2.5e-6, 'abc123', '2.13.0', 'cpu')",
    "INSERT INTO profiles (op, composite, kind, stack, workload, dtype, device, device_name, numel_bucket, batch_size, "
    "valid, detail, median_us, iqr_us, runs, peak_memory, source_hash, torch_version) VALUES ('to', 'native', "
    "'native', 'vmap,grad', 'vmap(grad)', 'float32', 'cpu', 'cpu', 256, 8, 1, '', 12.5, 0.5, 20, NULL, 'h', '2.13.0')",
    "INSERT INTO jobs (id, kind, params, state, done, total, owner, created_at, updated_at) VALUES ('j1', 'verify', "
    "'{\"ops\": [\"to\"]}', 'done', 3, 3, 'h:1', 1.0, 2.0)",
)


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database with no tables: a SQLite file not created yet, or an empty PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_empty_url")


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _columns(url: str, table: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        return inspect(engine).get_columns(table)
    finally:
        engine.dispose()


def _column_type(url: str, table: str, column: str) -> str:
    engine = create_engine(url)
    try:
        columns = {c["name"]: c["type"] for c in inspect(engine).get_columns(table)}
        return str(columns[column].compile(dialect=engine.dialect))
    finally:
        engine.dispose()


def test_a_store_made_before_migrations_upgrades_in_place(empty_url: str) -> None:
    url = empty_url
    _execute(url, *_legacy_ddl(url), *LEGACY_ROWS)
    assert migrate.current(url) is None
    if url.startswith("sqlite"):
        Store(url).close()  # a SQLite file is upgraded when opened: zero steps for the single user
    else:
        with pytest.raises(SchemaError) as refused:
            Store(url)
        shown = safe_url(url)  # as messages show a URL: the password masked, the socket path quoted
        assert str(refused.value) == (
            f"the store at {shown} is not migrated yet (no alembic_version), this multicomposite needs {HEAD}; run "
            "`multicomposite db upgrade` with MULTICOMPOSITE_DB set to this store, then start again")
        assert migrate.upgrade(url) == (None, HEAD)
    assert migrate.current(url) == HEAD
    assert _tables(url) == TABLES | {"alembic_version"}
    # Rows kept, stacks in the one spelling, the generation kept, the hand-made schema_version row gone.
    assert _execute(url, "SELECT stack FROM matrix_entries") == [("vmap(grad)",)]
    assert _execute(url, "SELECT stack FROM profiles") == [("vmap(grad)",)]
    assert _execute(url, "SELECT key, value FROM store_meta") == [("generation", 7)]
    # A row stored before 0003 has no measurement time; one written after has it.
    assert _execute(url, "SELECT measured_at FROM matrix_entries") == [(None,)]
    with Store(url) as store:
        assert store.entries() == [entry()]
        assert store.generation() == 7
        assert store.job("j1").params == {"ops": ["to"]}
        store.write_entries([entry(detail="after the upgrade")])
        assert store.entries() == [entry(detail="after the upgrade")]
        assert store.generation() == 8
        # 64-bit sizes: PostgreSQL's INTEGER would refuse 5 GiB of peak memory.
        big = ProfileEntry(op="to", composite="native", kind="native", stack=("vmap",), workload="vmap",
                           dtype="float32", device="cuda", device_name="H200", numel_bucket=2**33, batch_size=8,
                           valid=True, detail="", median_us=1.0, iqr_us=0.1, runs=5, peak_memory=5 * 2**30,
                           source_hash="h", torch_version="2.13.0")
        store.write_profiles([big])
        assert [p for p in store.profiles(device="cuda")] == [big]


def test_a_fresh_store_has_exactly_the_schema_of_the_models(empty_url: str) -> None:
    assert migrate.upgrade(empty_url) == (None, HEAD)
    engine = create_engine(empty_url)
    try:
        with engine.connect() as conn:
            differences = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), METADATA)
    finally:
        engine.dispose()
    if empty_url.startswith("sqlite"):
        # SQLite stores any INTEGER in up to 64 bits: 0002 leaves its INTEGER columns as they are (no table rebuild).
        widened = {("profiles", "numel_bucket"), ("profiles", "peak_memory"), ("store_meta", "value")}
        differences = [d for d in differences
                       if not (isinstance(d, list) and d[0][0] == "modify_type" and (d[0][2], d[0][3]) in widened)]
    assert differences == []


def test_revisions_go_down_and_up_again(empty_url: str) -> None:
    url = empty_url
    assert migrate.revisions() == ["0001", "0002", "0003", "0004", "0005", HEAD]
    assert migrate.upgrade(url, "0001") == (None, "0001")
    assert _execute(url, "SELECT key, value FROM store_meta ORDER BY key") == [("generation", 0),
                                                                               ("schema_version", 2)]
    postgres = url.startswith("postgresql")
    if postgres:
        assert _column_type(url, "profiles", "peak_memory") == "INTEGER"
    assert migrate.upgrade(url) == ("0001", HEAD)
    assert _execute(url, "SELECT key, value FROM store_meta") == [("generation", 0)]
    if postgres:
        assert _column_type(url, "profiles", "peak_memory") == "BIGINT"
    assert migrate.downgrade(url, "0001") == (HEAD, "0001")
    assert _execute(url, "SELECT key, value FROM store_meta ORDER BY key") == [("generation", 0),
                                                                               ("schema_version", 2)]
    assert migrate.upgrade(url) == ("0001", HEAD)
    with Store(url) as store:
        store.write_entries([entry(measured_at=1_790_000_000.5)])
    assert migrate.downgrade(url, "0002") == (HEAD, "0002")  # drops measured_at, keeps the row
    assert "measured_at" not in {c["name"] for c in _columns(url, "matrix_entries")}
    assert _execute(url, "SELECT op, status FROM matrix_entries") == [("index_fill", "ok")]
    assert migrate.upgrade(url) == ("0002", HEAD)
    assert _execute(url, "SELECT measured_at FROM matrix_entries") == [(None,)]
    assert migrate.downgrade(url, "0001") == (HEAD, "0001")
    assert migrate.downgrade(url, "base") == ("0001", None)
    assert _tables(url) == {"alembic_version"}
    assert migrate.upgrade(url) == (None, HEAD)
    with Store(url) as store:
        store.write_entries([entry()])
        assert store.entries() == [entry()]


def test_a_workers_table_made_by_create_all_is_kept_by_the_upgrade(empty_url: str) -> None:
    """Before revision 0005 the service and each worker made ``workers`` with ``create_all`` when they started: a
    store at 0004 with that table (and a worker's row in it) upgrades to head keeping both, and then has exactly the
    schema of the models."""
    from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text

    url = empty_url
    assert migrate.upgrade(url, "0004") == (None, "0004")
    assert "workers" not in _tables(url)
    made_then = MetaData()
    Table("workers", made_then, Column("id", String(300), primary_key=True),
          Column("host", String(300), nullable=False), Column("pid", Integer, nullable=False),
          Column("kinds", Text, nullable=False), Column("current_job", Text, nullable=True),
          Column("started_at", Float, nullable=False), Column("heartbeat", Float, nullable=False))
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            made_then.create_all(conn)
            conn.execute(text("INSERT INTO workers (id, host, pid, kinds, current_job, started_at, heartbeat) VALUES "
                              "('vm:7:abcdef', 'vm', 7, 'cpu', NULL, 1.0, 2.0)"))
    finally:
        engine.dispose()
    assert migrate.upgrade(url) == ("0004", HEAD)
    assert _tables(url) == TABLES | {"alembic_version"}
    assert _execute(url, "SELECT id, host, pid, kinds, started_at, heartbeat FROM workers") == [
        ("vm:7:abcdef", "vm", 7, "cpu", 1.0, 2.0)]
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            differences = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), METADATA)
    finally:
        engine.dispose()
    assert [d for d in differences if "workers" in repr(d)] == []
    assert migrate.downgrade(url, "0004") == (HEAD, "0004")
    assert "workers" not in _tables(url)


def _upgrade_in_child(url: str, go: Any, results: Any) -> None:
    go.wait(60)
    try:
        results.put(("ok", migrate.upgrade(url)))
    except BaseException as error:
        results.put(("error", f"{type(error).__name__}: {error}"))


@contextmanager
def _holding_the_migration_lock(url: str) -> Iterator[None]:
    """Hold what a migration takes first: PostgreSQL's advisory lock, SQLite's write lock (BEGIN IMMEDIATE)."""
    if url.startswith("sqlite"):
        raw = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            raw.execute("ROLLBACK")
            raw.close()
        return
    import psycopg

    params = make_url(url).query
    with psycopg.connect(host=params["host"], port=int(params["port"]), user="postgres",
                         dbname=make_url(url).database, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        yield
        conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))


def test_upgrades_running_at_once_migrate_once(empty_url: str) -> None:
    """Two machines running `db upgrade` together (two processes here): both wait on the migration lock while
    another holds it (PostgreSQL: an advisory lock; SQLite: BEGIN IMMEDIATE), then one migrates and the other finds
    the store at head. Neither fails on a table the other created, and the baseline's rows are written once."""
    if empty_url.startswith("sqlite"):
        sqlite3.connect(empty_url.removeprefix("sqlite:///")).close()  # the file, so that it can be locked
    context = multiprocessing.get_context("fork")
    go, results = context.Event(), context.Queue()
    # Forked before the lock is taken: a child must not inherit an open SQLite connection (SQLite's locks are
    # per process, its bookkeeping of them is not).
    children = [context.Process(target=_upgrade_in_child, args=(empty_url, go, results)) for _ in range(2)]
    for child in children:
        child.start()
    with _holding_the_migration_lock(empty_url):
        go.set()
        time.sleep(3)  # long enough to migrate an empty store many times over, were nothing queueing them
        assert results.empty(), "an upgrade ran while another process held the migration lock"
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)
    assert [kind for kind, _ in outcomes] == ["ok", "ok"], outcomes
    assert [after for _, (_, after) in outcomes] == [HEAD, HEAD]
    assert _execute(empty_url, "SELECT key, value FROM store_meta") == [("generation", 0)]
    assert _execute(empty_url, "SELECT version_num FROM alembic_version") == [(HEAD,)]


def test_a_store_of_an_unknown_revision_is_refused(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    _execute(empty_url, "UPDATE alembic_version SET version_num = 'ffff'")
    with pytest.raises(SchemaError) as refused:
        Store(empty_url)
    assert str(refused.value) == (
        f"the store at {safe_url(empty_url)} is at schema revision ffff, which this multicomposite does not know "
        f"(it knows up to {HEAD}): a newer version migrated it; update multicomposite on this machine")


def test_a_server_store_below_head_is_refused_until_upgraded(postgres_empty_url: str) -> None:
    url = postgres_empty_url
    migrate.upgrade(url, "0001")
    with pytest.raises(SchemaError) as refused:
        Store(url)
    assert str(refused.value) == (
        f"the store at {safe_url(url)} is at schema revision 0001, this multicomposite needs {HEAD}; run "
        "`multicomposite db upgrade` with MULTICOMPOSITE_DB set to this store, then start again")
    assert migrate.current(url) == "0001"  # refused, not touched


def test_the_server_refuses_to_start_on_an_unmigrated_server_store(postgres_empty_url: str) -> None:
    from service.state import StoreState

    state = StoreState(postgres_empty_url, 1.0, 1)
    with pytest.raises(SchemaError, match=r"^the store at .* is not migrated yet \(no alembic_version\)"):
        state.open()


def test_db_commands(empty_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = empty_url
    shown = safe_url(url)
    assert main(["db", "current", "--url", url]) == 0
    assert capsys.readouterr().out == (f"the store at {shown} has no schema revision (not migrated); the newest is "
                                       f"{HEAD}: run `multicomposite db upgrade`\n")
    assert main(["db", "upgrade", "--url", url, "--revision", "0001"]) == 0
    assert capsys.readouterr().out == f"the store at {shown}: no schema -> 0001\n"
    assert main(["db", "current", "--url", url]) == 0
    assert capsys.readouterr().out == (f"the store at {shown} is at revision 0001; the newest is {HEAD}: run "
                                       "`multicomposite db upgrade`\n")
    assert main(["db", "upgrade", "--url", url]) == 0
    assert capsys.readouterr().out == f"the store at {shown}: 0001 -> {HEAD} (head)\n"
    assert main(["db", "upgrade", "--url", url]) == 0
    assert capsys.readouterr().out == f"the store at {shown} is at revision {HEAD} (head) already\n"
    assert main(["db", "current", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"url": shown, "current": HEAD, "head": HEAD, "up_to_date": True}
    assert main(["db", "upgrade", "--url", url, "--revision", "9"]) == 2
    assert capsys.readouterr().err == ("multicomposite db: cannot upgrade to '9': Can't locate revision identified "
                                       "by '9'; known revisions: 0001, 0002, 0003, 0004, 0005, 0006\n")


def test_db_commands_name_an_unreachable_server_without_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://user:hunter2@127.0.0.1:1/store?connect_timeout=5"
    assert main(["db", "current", "--url", url]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err
    assert err.startswith("multicomposite db: the store at postgresql+psycopg://user:***@127.0.0.1:1/store?"
                          "connect_timeout=5 cannot be reached: OperationalError: (psycopg.OperationalError) "
                          "connection failed: ")
    assert err.endswith("; check the URL (MULTICOMPOSITE_DB or --url) and that the server is up\n")
