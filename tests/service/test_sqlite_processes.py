"""Issue 20, defect 1: a server and CLI processes on one SQLite store lost every write the server made.

``Store.check()`` opened and closed the store file on every watcher poll and every /readyz. Closing any descriptor
of a file drops every POSIX lock the process holds on it, SQLite's included: the next CLI process to close its
connection then believed it was the last one, checkpointed and deleted the ``-wal`` and ``-shm`` files the server
still wrote into. The server reported its job done; other processes saw none of it, and after a kill -9 it was gone.

Here a real server (``multicomposite serve``) and CLI readers and writers (``jobs --json``, ``matrix``, two ``verify``)
share one SQLite file, concurrently; then the server is killed (SIGKILL) and started again: every write is there,
seen by every process, and ``PRAGMA integrity_check`` says ok.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from registry.store.db import Store

ROOT = Path(__file__).resolve().parents[2]
SERVER_OP = "masked_fill"  # verified by a job of the server
CLI_OP = "t_copy"  # verified by a `multicomposite verify` process
SECOND_CLI_OP = "unsqueeze_copy"  # and by another, at the same time
ONE_CASE = ["--stack", "vmap", "--dtype", "float32"]


def _environment(url: str) -> dict[str, str]:
    # A short poll: the watcher's check runs many times while the CLI processes open and close the store.
    return {**os.environ, "PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": url, "MULTICOMPOSITE_JOBS": "in-process",
            "MULTICOMPOSITE_EVIDENCE_POLL_S": "0.05"}


def _start_server(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                return server, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise AssertionError(f"the server did not start (exit {server.poll()})")
        time.sleep(0.2)


def _cli(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, (process.args, process.returncode, stderr[-2000:])
    return stdout


def _wait_job(base: str, job_id: str) -> dict:
    deadline = time.monotonic() + 120
    while True:
        response = httpx.get(f"{base}/jobs/{job_id}", timeout=10)
        assert response.status_code == 200, response.text
        job = response.json()
        if job["state"] not in ("queued", "running"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def _cells(url: str, op: str) -> set[tuple]:
    with Store(url) as store:
        return {(e.op, e.composite, e.stack, e.pattern, e.dtype) for e in store.entries(op=op)}


def test_a_server_and_cli_processes_share_one_sqlite_store_through_a_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    env = _environment(url)
    server, base = _start_server(env)
    try:
        # Readers come and go while the server runs: each one's close is where the WAL was deleted.
        _finish(_cli(env, "jobs", "--json"))
        job_id = httpx.post(f"{base}/verify", json={"ops": [SERVER_OP], "stacks": ["vmap"], "dtypes": ["float32"]},
                            timeout=10).json()["id"]
        # Concurrently: the server's job, a CLI writer, and CLI readers.
        writer = _cli(env, "verify", "--op", CLI_OP, *ONE_CASE, "--json")
        second_writer = _cli(env, "verify", "--op", SECOND_CLI_OP, *ONE_CASE, "--json")
        readers = [_cli(env, "jobs", "--json"), _cli(env, "matrix", "--op", SERVER_OP), _cli(env, "jobs", "--json")]
        job = _wait_job(base, job_id)
        assert job["state"] == "done", job
        written_by_server = job["result"]["entries"]
        assert written_by_server > 0
        cli_entries = json.loads(_finish(writer))
        assert cli_entries
        second_entries = json.loads(_finish(second_writer))
        assert second_entries
        for reader in readers:
            process_output = reader.communicate(timeout=120)
            # `matrix` may run before any entry is there (exit 2, one line); the others must succeed.
            assert reader.returncode in ((0, 2) if "matrix" in reader.args else (0,)), process_output
        # Every process sees the server's job and the CLI's entries while the server still runs.
        seen = {job["id"]: job for job in json.loads(_finish(_cli(env, "jobs", "--json")))}
        assert seen[job_id]["state"] == "done"
        assert len(_cells(url, SERVER_OP)) == written_by_server
        for op, entries in ((CLI_OP, cli_entries), (SECOND_CLI_OP, second_entries)):
            assert len(_cells(url, op)) == len({(e["op"], e["composite"], e["stack"], e["pattern"], e["dtype"])
                                                for e in entries})
        # And the server sees the CLI's write (through the shared WAL, not a copy of its own).
        deadline = time.monotonic() + 10
        while not httpx.get(f"{base}/matrix", params={"op": CLI_OP}, timeout=10).json()["items"]:
            assert time.monotonic() < deadline, "the server never saw the CLI's entries"
            time.sleep(0.1)
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait(20)

    server_cells, cli_cells, second_cells = _cells(url, SERVER_OP), _cells(url, CLI_OP), _cells(url, SECOND_CLI_OP)
    server, base = _start_server(env)
    try:
        again = httpx.get(f"{base}/jobs/{job_id}", timeout=10)
        assert again.status_code == 200, again.text
        assert (again.json()["state"], again.json()["result"]["entries"]) == ("done", written_by_server)
        assert len(server_cells) == written_by_server
        assert cli_cells and second_cells
        assert _cells(url, SERVER_OP) == server_cells and _cells(url, CLI_OP) == cli_cells
        assert _cells(url, SECOND_CLI_OP) == second_cells
    finally:
        server.terminate()
        server.wait(20)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
