"""Writes that fail lose nothing (issue 29.2): the disk full while ``verify`` or ``profile`` writes, a read-only store,
PostgreSQL gone in the middle of a write. The command says one line and exits 3; the store keeps every earlier row
and passes its integrity check; a job fails with the reason; the service answers 503 on writing routes and serves
reads on."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from registry.core.sources import source_hashes
from registry.store.connection import StoreUnavailableError
from registry.store.db import Store
from registry.store.records import MatrixEntry

ROOT = Path(__file__).resolve().parents[2]
FRAME = 4096 + 24  # one page in SQLite's -wal


def _earlier_rows(url: str, *, older: int = 0) -> list[MatrixEntry]:
    """Rows a run wrote before (``older``: as many of other torch versions besides)."""
    hashes = source_hashes()
    versions = [torch.__version__, *(f"0.0.{n}" for n in range(older))]
    rows = [MatrixEntry(op="masked_fill", composite="functional", kind="functional", stack=("vmap",), pattern=pattern,
                        dtype="float32", status="ok", detail="", max_abs_error=0.0, max_rel_error=0.0,
                        source_hash=hashes[("masked_fill", "functional")], torch_version=version,
                        device="cpu") for pattern in ("self", "all") for version in versions]
    with Store(url) as store:
        store.write_entries(rows)
    return rows


def _stored(url: str) -> list[tuple[str, str, str]]:
    with Store(url) as store:
        assert store.integrity_ok()
        return sorted((e.op, e.composite, e.pattern, e.torch_version) for e in store.entries())


# The command, in a process whose files may grow only to the given size (RLIMIT_FSIZE: Python ignores SIGXFSZ, so
# a write past it fails with EFBIG, which SQLite reports as a full disk).
LIMITED = textwrap.dedent("""
    import resource, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from service.cli import main
    sys.exit(main(sys.argv[2:]))
""")


# verify: room for its run's record (two pages), not for its entries, which it always writes. profile: no room at
# all, its run's record is refused (on a loaded machine its timings may all come back disturbed, and then it has no
# timings to write).
@pytest.mark.parametrize(("command", "pages"), [
    (["verify", "--op", "index_fill", "--stack", "vmap", "--dtype", "float32"], 2),
    (["profile", "--op", "index_fill", "--stack", "vmap", "--batch", "1", "--min-run-time", "0.01"], 0),
], ids=["verify", "profile"])
def test_a_full_disk_while_a_command_writes(tmp_path: Path, command: list[str], pages: int) -> None:
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    _earlier_rows(url)
    # A reader holding its snapshot keeps SQLite from starting the -wal over: the rows written after it fill the
    # -wal past the -shm's 32 KiB, every write of the command appends to it, and the limit is reached in two pages.
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM matrix_entries").fetchall()
    earlier = _earlier_rows(url, older=300)
    try:
        wal = Path(f"{path}-wal").stat().st_size
        assert wal > 32768
        limit = wal + pages * FRAME
        done = subprocess.run([sys.executable, "-c", LIMITED, str(limit), *command], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "MULTICOMPOSITE_DB": url, "PYTHONPATH": str(ROOT),
                                                "MULTICOMPOSITE_ROUTING": "python"})
    finally:
        reader.execute("ROLLBACK")
        reader.close()
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"multicomposite {command[0]}: the store at {url} failed ")
    # EFBIG is an I/O error to SQLite (ENOSPC would be SQLITE_FULL); pages reach the -wal at the commit.
    assert "disk I/O error" in last or "database or disk is full" in last, last
    assert "nothing of it is stored" in last or "read it back" in last, last
    assert _stored(url) == sorted((e.op, e.composite, e.pattern, e.torch_version) for e in earlier)


def _read_only(store: Store) -> Callable[[bool], None]:
    """``set(True)``: every connection of ``store`` refuses writes from now on, as a read-only file does (the same
    driver error, SQLITE_READONLY); ``set(False)``: writable again. Root writes any file whatever its mode, so the
    refusal is SQLite's own (``PRAGMA query_only``)."""
    from sqlalchemy import event

    state = {"on": False}

    def connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute(f"PRAGMA query_only={int(state['on'])}")

    event.listen(store.engine, "connect", connect)

    def switch(on: bool) -> None:
        state["on"] = on
        store.engine.dispose()  # new connections take the new setting

    return switch


def test_a_read_only_store_under_the_service(serve, tmp_path: Path) -> None:
    """Writing routes answer 503 saying why, reads go on, and a job whose results cannot be written fails with the
    reason; nothing of it is stored."""
    client: TestClient = serve()
    store = client.app.state.store_state.store
    earlier = _earlier_rows(store.url)
    client.app.state.store_state.poll()
    read_only = _read_only(store)
    started, go_on = threading.Event(), threading.Event()

    def run(job: Any, progress: Callable[[int, int], None]) -> dict[str, Any]:
        progress(1, 2)
        started.set()
        assert go_on.wait(30)
        hashes = source_hashes()
        store.write_entries([MatrixEntry(
            op="index_fill", composite="functional", kind="functional", stack=("vmap",), pattern="all",
            dtype="float32", status="ok", detail="", max_abs_error=0.0, max_rel_error=0.0,
            source_hash=hashes[("index_fill", "functional")], torch_version=torch.__version__, device="cpu")])
        return {"entries": 1}

    client.app.state.runner._run = run
    job_id = client.post("/verify", json={"ops": ["index_fill"], "stacks": ["vmap"]}).json()["id"]
    assert started.wait(30)
    read_only(True)
    go_on.set()
    refused = client.post("/verify", json={"ops": ["index_fill"], "stacks": ["vmap"]})
    assert refused.status_code == 503, refused.text
    assert "readonly database" in refused.json()["detail"] and refused.headers["Retry-After"]
    for route in ("/matrix", "/select?op=masked_fill&stack=vmap", "/ops/masked_fill", f"/jobs/{job_id}", "/readyz"):
        assert client.get(route).status_code == 200, route
    time.sleep(1.0)  # the job's end is refused too, and retried
    assert client.get(f"/jobs/{job_id}").json()["state"] == "running"
    read_only(False)
    deadline = time.monotonic() + 30
    while (job := client.get(f"/jobs/{job_id}").json())["state"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["state"] == "failed"
    assert job["error"].startswith("StoreUnavailableError: the store at ") and "readonly database" in job["error"]
    assert _stored(store.url) == sorted((e.op, e.composite, e.pattern, e.torch_version) for e in earlier)


def test_postgres_gone_in_the_middle_of_a_write(postgres_own_server) -> None:
    """The server killed while a transaction writes: StoreUnavailableError saying it was rolled back; once the
    server is back, every earlier row is there and none of the write."""
    from registry.store.migrate import upgrade

    url = postgres_own_server.create_database()
    upgrade(url)
    earlier = _earlier_rows(url)
    store = Store(url)
    try:
        entries = [MatrixEntry(
            op="index_fill", composite="functional", kind="functional", stack=("vmap",), pattern=pattern,
            dtype="float32", status="ok", detail="", max_abs_error=0.0, max_rel_error=0.0, source_hash="h",
            torch_version=torch.__version__, device="cpu") for pattern in ("self", "all")]
        original = store._bump  # the first statement of the write: the server dies right after it

        def bump_then_die(conn: Any) -> None:
            original(conn)
            postgres_own_server.kill()

        store._bump = bump_then_die  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailableError, match="rolled back, nothing of it is stored"):
            store.write_entries(entries)
    finally:
        store.close()
    postgres_own_server.restart()
    assert _stored(url) == sorted((e.op, e.composite, e.pattern, e.torch_version) for e in earlier)


@pytest.mark.parametrize("damage", ["deleted", "replaced"])
def test_a_write_into_a_file_deleted_or_replaced_is_refused(tmp_path: Path, damage: str) -> None:
    """A process that opened the store before its file was deleted or replaced would write into the old file, which
    no one reads: the write is refused instead, saying so, and the file at the path is left as it is."""
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    earlier = _earlier_rows(url)
    store = Store(url)
    try:
        store.generation()  # a pooled connection on the file
        moved = tmp_path / "moved.db"
        path.rename(moved)
        for suffix in ("-wal", "-shm"):
            if Path(f"{path}{suffix}").exists():
                Path(f"{path}{suffix}").rename(f"{moved}{suffix}")
        if damage == "replaced":
            _earlier_rows(url)  # another store made at the path
        what = "does not exist any more" if damage == "deleted" else "was replaced by another file"
        with pytest.raises(StoreUnavailableError, match=f"{what} since this process opened it; nothing of this"):
            store.write_entries(earlier)
    finally:
        store.close()
    assert _stored(f"sqlite:///{moved}") == sorted((e.op, e.composite, e.pattern, e.torch_version) for e in earlier)
