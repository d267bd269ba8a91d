"""use() never fails because of its store: every store it cannot read gives one warning, then the decisions of a run
with no store at all, right values, and the evidence once the store reads again (issue 29.1)."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import func

import registry
from registry.core.sources import source_hashes
from registry.store import evidence, health
from registry.store.connection import ENV_VAR

pytest.importorskip("sqlalchemy")

from registry.store.db import Store
from registry.store.records import MatrixEntry

ROOT = Path(__file__).resolve().parents[3]
STACKS = ("", "vmap", "grad", "vmap(grad)", "vmap(vmap)", "jvp")
INDEX = torch.tensor([0, 2])


def _program(x: torch.Tensor) -> torch.Tensor:
    """A per-sample gradient through a routed op: what a training script inside use() runs."""
    return func.vmap(func.grad(lambda row: torch.index_fill(row, 0, INDEX, 1.0).sin().sum()))(x)


def _decisions() -> list[tuple[str, str, str]]:
    chosen = []
    for op in sorted(registry.OPS):
        for stack in STACKS:
            try:
                chosen.append((op, stack, registry.select(op, stack=stack).composite))
            except registry.SelectionError as error:
                chosen.append((op, stack, f"refused: {type(error).__name__}"))
    return chosen


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A fresh process's view of the store: nothing read, no warning given; short waits."""
    monkeypatch.setattr(health, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(health, "RETRY_S", 0.1)
    health.HEALTH.reset()
    evidence.use_loader(None)
    evidence.use_profile_loader(None)
    yield
    health.HEALTH.reset()
    evidence.use_loader(None)
    evidence.use_profile_loader(None)


def _no_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_VAR, f"sqlite:///{tmp_path / 'never-written.db'}")
    evidence.reload()


@pytest.fixture
def baseline(fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[list, torch.Tensor]:
    """The decisions and the program's result with no store at all."""
    _no_store(monkeypatch, tmp_path)
    x = torch.randn(3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no store: nothing to warn about
        with registry.use():
            result = _program(x)
        chosen = _decisions()
    health.HEALTH.reset()
    return chosen, x, result


def _run_degraded(baseline: tuple[list, torch.Tensor, torch.Tensor], url_shown: str) -> str:
    """The program twice and the decisions, under the broken store: one warning, the no-store run's answers."""
    chosen, x, expected = baseline
    evidence.reload()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with registry.use():
                assert torch.allclose(_program(x), expected)
        assert _decisions() == chosen
        status = registry.store_status()
    store_warnings = [w for w in caught if "cannot be read" in str(w.message)]
    assert len(store_warnings) == 1, [str(w.message) for w in caught]
    (warning,) = store_warnings
    message = str(warning.message)
    assert warning.category is RuntimeWarning
    assert url_shown in message and "decides from the rules and the reference profiles" in message
    assert not status.readable and status.problem is not None
    assert url_shown in str(status)
    return message


def test_a_file_that_is_not_a_database(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "damaged.db"
    path.write_bytes(b"this is not a database" * 500)
    monkeypatch.setenv(ENV_VAR, f"sqlite:///{path}")
    message = _run_degraded(baseline, str(path))
    assert "not a SQLite database" in message and ".backup" in message


def test_a_data_folder_that_cannot_be_created(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker))  # a folder cannot be made under a file, root or not
    chosen, x, expected = baseline
    evidence.reload()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with registry.use():
            assert torch.allclose(_program(x), expected)
        assert _decisions() == chosen
    (warning,) = [w for w in caught if "cannot be read" in str(w.message)]
    assert ENV_VAR in str(warning.message)
    assert registry.store_status().problem is not None


def test_a_store_folder_that_does_not_exist(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "no-such-folder" / "store.db"
    monkeypatch.setenv(ENV_VAR, f"sqlite:///{path}")
    message = _run_degraded(baseline, str(path))
    assert "does not exist" in message
    assert not path.parent.exists(), "nothing is created by reading"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_postgres_server_that_is_down(baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("psycopg")
    url = f"postgresql+psycopg://someone:secret@127.0.0.1:{_free_port()}/multicomposite"
    monkeypatch.setenv(ENV_VAR, url)
    message = _run_degraded(baseline, "postgresql+psycopg://someone:***@127.0.0.1")
    assert "secret" not in message and "OperationalError" in message


def test_a_server_that_accepts_and_never_answers(baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """A network that drops packets after the connect, or a server stuck: bounded by the connect timeout."""
    pytest.importorskip("psycopg")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])  # accepted, never answered
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        monkeypatch.setenv(ENV_VAR, f"postgresql+psycopg://someone@127.0.0.1:{silent.getsockname()[1]}/db")
        started = time.monotonic()
        _run_degraded(baseline, f"127.0.0.1:{silent.getsockname()[1]}")
        # Three bounded reads (the first routed call, a decision after the reload, store_status): not a hang.
        assert time.monotonic() - started < 60
    finally:
        stop.set()
        acceptor.join()
        for connection in held:
            connection.close()
        silent.close()


def _store_with_evidence(path: Path) -> str:
    """A store whose evidence changes index_fill's decision under vmap(grad): the rules' choice fails there."""
    url = f"sqlite:///{path}"
    chosen = registry.select("index_fill", stack="vmap(grad)").composite
    with Store(url) as store:
        store.write_entries([MatrixEntry(
            op="index_fill", composite=chosen, kind=registry.COMPOSITES["index_fill"][chosen].kind,
            stack=("vmap", "grad"), pattern=pattern, dtype="float32", status="error", detail="raises",
            max_abs_error=None, max_rel_error=None, source_hash=source_hashes()[("index_fill", chosen)],
            torch_version=torch.__version__, device="cpu") for pattern in ("self", "all", "others", "in_dims1")])
    return url


def test_a_newer_schema(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    _store_with_evidence(path)
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'ffff_from_the_future'")
    connection.close()
    monkeypatch.setenv(ENV_VAR, f"sqlite:///{path}")
    message = _run_degraded(baseline, str(path))
    assert "ffff_from_the_future" in message and "update multicomposite" in message


def test_a_held_lock(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another process holds the file's lock (exclusive locking mode): the read gives up after its timeout."""
    path = tmp_path / "locked.db"
    _store_with_evidence(path)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, sys, time
        connection = sqlite3.connect({str(path)!r}, isolation_level=None)
        connection.execute("PRAGMA locking_mode=EXCLUSIVE")
        connection.execute("BEGIN EXCLUSIVE")
        connection.execute("UPDATE store_meta SET value = value + 1")
        print("held", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv(ENV_VAR, f"sqlite:///{path}")
        _run_degraded(baseline, str(path))
    finally:
        holder.communicate("")


def test_deleted_while_running_then_back(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A store read, then deleted: one warning, the no-store decisions; put back, its evidence is read again
    without any call from the program (the background retry)."""
    chosen, x, expected = baseline
    path = tmp_path / "store.db"
    url = _store_with_evidence(path)
    monkeypatch.setenv(ENV_VAR, url)
    evidence.reload()
    with registry.use():
        assert torch.allclose(_program(x), expected)
    with_evidence = registry.select("index_fill", stack="vmap(grad)").composite
    no_store = dict(((op, stack), c) for op, stack, c in chosen)[("index_fill", "vmap(grad)")]
    assert with_evidence != no_store
    backup = tmp_path / "backup.db"
    with sqlite3.connect(path) as live, sqlite3.connect(backup) as copy:
        live.backup(copy)
    live.close()
    copy.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    message = _run_degraded(baseline, str(path))
    assert "does not exist now" in message
    backup.replace(path)
    deadline = time.monotonic() + 30
    while registry.select("index_fill", stack="vmap(grad)").composite != with_evidence:
        assert time.monotonic() < deadline, "the store put back was not read again"
        time.sleep(0.05)
    assert registry.store_status().readable


def test_store_status_of_a_readable_store(fresh, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url = _store_with_evidence(tmp_path / "store.db")
    monkeypatch.setenv(ENV_VAR, url)
    status = registry.store_status()
    assert (status.url, status.exists, status.readable, status.problem) == (url, True, True, None)
    assert str(status) == f"the store at {url} is readable"
    monkeypatch.setenv(ENV_VAR, f"sqlite:///{tmp_path / 'other.db'}")
    assert not registry.store_status().exists


def _read_only_folder(folder: Path) -> Callable[[], None] | None:
    """Make ``folder`` read-only for this process; returns how to undo it, or None where it cannot be done. As root
    permissions are not checked: a read-only bind mount instead."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    mount = shutil.which("mount")
    if mount is None or subprocess.run([mount, "--bind", str(folder), str(folder)], capture_output=True).returncode:
        return None
    if subprocess.run([mount, "-o", "remount,bind,ro", str(folder)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(folder)], check=True)
        return None
    return lambda: subprocess.run(["umount", "-l", str(folder)], check=True)  # lazy: a retry may have it open


@pytest.mark.parametrize("damage", ["unreadable file", "read-only folder", "a folder in its place"])
def test_a_store_made_unreadable_while_running(baseline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                damage: str) -> None:
    _, x, expected = baseline
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "store.db"
    url = _store_with_evidence(path)
    monkeypatch.setenv(ENV_VAR, url)
    evidence.reload()
    with registry.use():
        assert torch.allclose(_program(x), expected)
    assert registry.store_status().readable
    undo = None
    if damage == "unreadable file":
        if os.geteuid() == 0:
            pytest.skip("root reads every file whatever its mode")
        path.chmod(0o000)
        undo = lambda: path.chmod(0o644)  # noqa: E731
    elif damage == "read-only folder":
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)  # closed and checkpointed: the file alone
        undo = _read_only_folder(folder)
        if undo is None:
            pytest.skip("cannot make a folder read-only here (root without mount)")
    else:
        path.rename(folder / "moved.db")
        path.mkdir()
    try:
        message = _run_degraded(baseline, str(path))
        assert ENV_VAR in message
    finally:
        if undo is not None:
            undo()
