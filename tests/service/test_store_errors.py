"""Defect 4: with the store missing or corrupt, /select, /ops/{op}, /matrix and /profiles answered a plain-text 500
with a traceback. Now every store-backed route answers JSON 503 saying what is wrong, and answers again once the
store is back."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

STORE_ROUTES = ("/select?op=index_fill", "/ops/index_fill", "/matrix", "/profiles", "/readyz", "/jobs/abc")
ADVICE = "; check MULTICOMPOSITE_DB and the file, then retry (GET /readyz says when it is back)"


def _all_503(client: TestClient, detail: str) -> None:
    for route in STORE_ROUTES:
        response = client.get(route)
        assert response.status_code == 503, (route, response.text)
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {"detail": detail + ADVICE}, route
    assert client.get("/healthz").json() == {"status": "ok"}  # alive all the same


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_every_store_route_answers_503_json_then_recovers(serve, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "store.db"
    client: TestClient = serve()
    for route in STORE_ROUTES[:-1]:
        assert client.get(route).status_code == 200, route  # and cached: the damage must still show
    backup = tmp_path / "backup.db"
    # Through SQLite's backup API: a copy of the file alone misses what is still in its -wal.
    with sqlite3.connect(path) as live, sqlite3.connect(backup) as copy:
        live.backup(copy)
    live.close()
    copy.close()
    state = client.app.state.store_state
    if damage == "missing":
        path.unlink()
        expected = f"the store file {path} does not exist"
    else:
        # Another file put in its place (a wrong copy, a restore gone bad). Not an overwrite in place: while the
        # server's -wal holds the pages, SQLite reads them from there and the damage does not show until a checkpoint;
        # looking at the file's bytes ourselves is what dropped SQLite's locks (issue 20).
        wrong = tmp_path / "wrong.db"
        wrong.write_bytes(b"this is not a database" * 1000)
        wrong.replace(path)
        expected = f"the store file {path} is not a SQLite database (bad header)"
    state.poll()
    _all_503(client, expected)
    shutil.copy(backup, path)
    state.poll()
    assert client.get("/select", params={"op": "index_fill"}).status_code == 200
    assert client.get("/readyz").json() == {"status": "ok"}


def test_a_driver_error_inside_a_request_is_503_json(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    from sqlalchemy.exc import OperationalError

    client: TestClient = serve()
    store = client.app.state.store_state.store

    def broken(**_kwargs: object) -> list:
        raise OperationalError("SELECT ...", {}, sqlite3.OperationalError("disk I/O error"))

    monkeypatch.setattr(store, "fresh_entries", broken)
    response = client.get("/matrix")
    assert response.status_code == 503
    assert response.json() == {"detail": "the store cannot be read: OperationalError: (sqlite3.OperationalError) "
                                         "disk I/O error" + ADVICE}


def test_a_postgres_server_killed_and_restarted(postgres_own_server, serve) -> None:
    """PostgreSQL killed (kill -9) under a running service: every store route answers 503 JSON naming the store
    and the driver's reason, /healthz stays up; once the server is back the same app answers again. (The server
    fixture comes first: it is torn down after the app, which closes its pool while PostgreSQL still answers.)"""
    from registry.store.database import safe_url
    from registry.store.migrate import upgrade

    url = postgres_own_server.create_database()
    upgrade(url)
    client: TestClient = serve(db=url)
    assert client.get("/matrix").status_code == 200
    state = client.app.state.store_state
    postgres_own_server.kill()
    state.poll()
    for route in STORE_ROUTES:
        response = client.get(route)
        assert response.status_code == 503, (route, response.text)
        detail = response.json()["detail"]
        assert detail.startswith(f"the store at {safe_url(url)} cannot be read: OperationalError: "
                                 "(psycopg.OperationalError) connection "), detail
        assert detail.endswith(ADVICE)
    assert client.get("/healthz").json() == {"status": "ok"}
    postgres_own_server.restart()
    state.poll()
    assert client.get("/readyz").json() == {"status": "ok"}
    assert client.get("/matrix").status_code == 200
