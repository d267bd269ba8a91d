"""containers/multicomposite/wait-for-store.py: what the composed stack's containers run before they use the store."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "containers" / "multicomposite" / "wait-for-store.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wait_for_store", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wait = _load()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unset_url_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MULTICOMPOSITE_DB", raising=False)
    assert wait.main([]) == 2
    assert capsys.readouterr().err == ("wait-for-store: MULTICOMPOSITE_DB is not set; set it to the store's "
                                       "SQLAlchemy URL\n")


def test_a_url_that_is_not_one_is_refused(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MULTICOMPOSITE_DB", "postgres at the usual place")
    assert wait.main([]) == 2
    assert capsys.readouterr().err == ("wait-for-store: MULTICOMPOSITE_DB cannot be used: Could not parse SQLAlchemy "
                                       "URL from given URL string\n")


def test_a_store_that_answers_returns_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/store.db"
    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    assert wait.main(["--timeout", "5"]) == 0
    assert capsys.readouterr().out == f"wait-for-store: {url} answers\n"


def test_a_server_that_never_answers_times_out_naming_it_without_the_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psycopg")
    port = _closed_port()
    monkeypatch.setenv("MULTICOMPOSITE_DB", f"postgresql+psycopg://mc:hunter2@127.0.0.1:{port}/mc")
    assert wait.main(["--timeout", "0.3", "--interval", "0.1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"wait-for-store: postgresql+psycopg://mc:***@127.0.0.1:{port}/mc not ready within 0.3 s: ")
    assert f'connection to server at "127.0.0.1", port {port} failed: Connection refused' in err
    assert "hunter2" not in err
    assert err.count("\n") == 1


def test_it_retries_until_the_deadline() -> None:
    pytest.importorskip("psycopg")
    now = [1000.0]
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        now[0] += seconds

    url = f"postgresql+psycopg://mc:pw@127.0.0.1:{_closed_port()}/mc"
    reason = wait.wait_for_store(url, timeout_s=60.0, interval_s=20.0, sleep=nap, clock=lambda: now[0])
    # 60 s allow tries at 0, 20, 40 and 60 s: three naps in between, and none that would end past the deadline.
    assert naps == [20.0, 20.0, 20.0]
    assert reason is not None and "Connection refused" in reason


def test_schema_current_waits_for_the_migration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    migrate = pytest.importorskip("registry.store.migrate")
    url = f"sqlite:///{tmp_path}/store.db"
    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    assert wait.main(["--schema-current", "--timeout", "0.2", "--interval", "0.1"]) == 1
    assert capsys.readouterr().err == (
        f"wait-for-store: {url} not ready within 0.2 s: not migrated (no schema revision), not at {migrate.head()}; "
        "is `multicomposite db upgrade` running (the migrate container)?\n")
    migrate.upgrade(url)
    assert wait.main(["--schema-current", "--timeout", "5"]) == 0
    assert capsys.readouterr().out == f"wait-for-store: {url} is at the newest schema\n"
