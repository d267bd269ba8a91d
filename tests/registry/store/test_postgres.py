"""The store on a real PostgreSQL server (tests/pgserver.py starts it): two processes writing at once, and a write
transaction cut off by a terminated backend or by the server killed with kill -9."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from sqlalchemy import make_url

from registry.store.connection import StoreUnavailableError
from registry.store.database import safe_url
from registry.store.db import Store
from registry.store.migrate import upgrade
from registry.store.records import JobRecord
from tests.pgserver import PostgresServer
from tests.registry.store.test_store import entry

BATCHES = 30  # per process
BATCH = 12  # entries per batch: 8 of the process's own, 4 that both processes write (the same keys)
SHARED = 4


def _write_in_child(url: str, name: str, go: Any, results: Any) -> None:
    """One writer: BATCHES batches of matrix entries (some keys shared with the other writer), a job per batch."""
    go.wait(60)
    try:
        with Store(url) as store:
            for batch in range(BATCHES):
                own = [entry(op=f"own_{name}", pattern=f"b{batch}_{i}", detail=f"{name}:{batch}")
                       for i in range(BATCH - SHARED)]
                shared = [entry(op="shared", pattern=f"p{i}", detail=f"{name}:{batch}") for i in range(SHARED)]
                # Interleave, so each batch's rows arrive in another order than the keys sort.
                store.write_entries([*shared[::-1], *own[::-1]])
                store.add_job(JobRecord(id=f"{name}-{batch}", kind="verify", params={"batch": batch}, owner=name))
                store.update_job(f"{name}-{batch}", state="done", done=batch, total=BATCHES)
        results.put((name, "ok"))
    except BaseException as error:
        results.put((name, f"{type(error).__name__}: {error}"))


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_processes_writing_at_once(request: pytest.FixtureRequest, tmp_path: Any, backend: str) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    Store(url).close()  # migrated (SQLite) before the children fork, and no connection left open across the fork
    context = multiprocessing.get_context("fork")
    go, results = context.Event(), context.Queue()
    children = [context.Process(target=_write_in_child, args=(url, name, go, results)) for name in ("a", "b")]
    for child in children:
        child.start()
    go.set()
    outcomes = dict(results.get(timeout=300) for _ in children)
    for child in children:
        child.join(30)
    assert outcomes == {"a": "ok", "b": "ok"}
    with Store(url) as store:
        rows = store.entries()
        assert Counter(e.op for e in rows) == {"own_a": BATCHES * (BATCH - SHARED),
                                               "own_b": BATCHES * (BATCH - SHARED), "shared": SHARED}
        # Every batch complete: each own batch has all its rows, with its own detail.
        assert Counter(e.detail for e in rows if e.op != "shared") == {
            f"{name}:{batch}": BATCH - SHARED for name in "ab" for batch in range(BATCHES)}
        # The shared keys hold one writer's last batch, all four from the same write (writes do not interleave).
        shared = {e.detail for e in rows if e.op == "shared"}
        assert shared in ({f"a:{BATCHES - 1}"}, {f"b:{BATCHES - 1}"}), shared
        assert store.generation() == 2 * BATCHES  # every write counted, none lost to a concurrent increment
        jobs = store.jobs()
        assert len(jobs) == 2 * BATCHES
        assert {(j.state, j.done) for j in jobs if j.id == "b-7"} == {("done", 7)}


# A write cut off mid-transaction ----------------------------------------------------------------------------------


def _raw(url: str) -> psycopg.Connection:
    parsed = make_url(url)
    return psycopg.connect(host=parsed.query["host"], port=int(parsed.query["port"]), user=parsed.username,
                           dbname=parsed.database, autocommit=True)


def _blocked_write(url: str) -> tuple[Store, psycopg.Connection, threading.Thread, list[BaseException], int]:
    """A store holding one row, and a write of 20 rows stopped half-way inside its transaction: it has counted the
    write and inserted the rows that sort before "zz", then waits for the row "zz", which another connection holds
    locked. Returns the store, that connection, the writing thread, where its error lands, and its backend pid."""
    store = Store(url)
    store.write_entries([entry(op="zz", detail="before")])
    holder = _raw(url)
    holder.execute("BEGIN")
    holder.execute("SELECT * FROM matrix_entries WHERE op = 'zz' FOR UPDATE")
    errors: list[BaseException] = []

    def write() -> None:
        try:
            store.write_entries([entry(op=f"op{i:02}", detail="cut off") for i in range(19)]
                                + [entry(op="zz", detail="cut off")])
        except BaseException as error:
            errors.append(error)

    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 30
    while True:
        waiting = holder.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
                                 "wait_event_type = 'Lock'").fetchall()
        if waiting:
            break
        assert time.monotonic() < deadline, "the write did not reach the locked row"
        time.sleep(0.05)
    # Mid-transaction: the counter and 19 rows are written, uncommitted (the holder sees none of them).
    assert holder.execute("SELECT count(*) FROM matrix_entries").fetchone() == (1,)
    return store, holder, writer, errors, waiting[0][0]


def _assert_nothing_half_written(store: Store) -> None:
    assert store.entries() == [entry(op="zz", detail="before")]
    assert store.generation() == 1
    store.write_entries([entry(op="after", detail="works again")])  # and the store works again
    assert [e.op for e in store.entries()] == ["after", "zz"]
    assert store.generation() == 2


def test_a_terminated_backend_mid_write_rolls_back_and_says_so(postgres_url: str) -> None:
    store, holder, writer, errors, backend = _blocked_write(postgres_url)
    try:
        assert holder.execute("SELECT pg_terminate_backend(%s)", (backend,)).fetchone() == (True,)
        writer.join(30)
        assert len(errors) == 1 and isinstance(errors[0], StoreUnavailableError), errors
        # Which of the two the driver reports depends on whether it read the server's goodbye before the socket
        # closed.
        causes = ("(psycopg.errors.AdminShutdown) terminating connection due to administrator command",
                  "(psycopg.OperationalError) consuming input failed: server closed the connection unexpectedly")
        assert str(errors[0]) in {
            f"the store at {safe_url(postgres_url)} failed during a write (OperationalError: {cause}); it was "
            "rolled back, nothing of it is stored; retry once the store answers again" for cause in causes}
        holder.execute("ROLLBACK")
        _assert_nothing_half_written(store)
    finally:
        holder.close()
        store.close()


def test_the_server_killed_mid_write_then_restarted(postgres_own_server: PostgresServer) -> None:
    own_server = postgres_own_server
    url = own_server.create_database()
    upgrade(url)
    store, holder, writer, errors, _backend = _blocked_write(url)
    try:
        own_server.kill()  # kill -9 of the postmaster; its backends, the writer's included, exit with it
        writer.join(30)
        assert len(errors) == 1 and isinstance(errors[0], StoreUnavailableError), errors
        message = str(errors[0])
        assert message.startswith(f"the store at {safe_url(url)} failed during a write (OperationalError: "), message
        assert message.endswith("); it was rolled back, nothing of it is stored; retry once the store answers "
                                "again"), message
        # While it is down, reads say so in one line.
        down = (r"^the store at .* cannot be read: OperationalError: \(psycopg.OperationalError\) connection (is bad|"
                r"failed): connection to server on socket \"[^\"]+\" failed: (Connection refused|No such file)")
        with pytest.raises(StoreUnavailableError, match=down):
            store.entries()
        own_server.restart()  # crash recovery replays the WAL: only committed transactions come back
        _assert_nothing_half_written(store)  # the same Store: its pool replaces the dead connections
    finally:
        holder.close()
        store.close()
