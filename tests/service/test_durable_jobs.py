"""Defect 7: jobs lived only in memory (after a restart GET /jobs/{id} was 404 and queued work was gone), and the
job list was never pruned. Jobs are rows in the store now."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from registry.store.db import Store
from registry.store.records import JobRecord

ROOT = Path(__file__).resolve().parents[2]
DEAD = f"{socket.gethostname()}:999999999"  # a process id no process has

# Each test that uses a store runs on SQLite and on PostgreSQL (tests/service/conftest.py).
STORE_BACKENDS = ("sqlite", "postgres")


def _wait(client: TestClient, job_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {job}")


def test_jobs_outlive_the_server(serve) -> None:
    first = serve()
    first.app.state.runner._run = lambda job, progress: (progress(3, 3), {"answer": 42})[1]
    job_id = first.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap"]}).json()["id"]
    assert _wait(first, job_id)["result"] == {"answer": 42}
    second = serve()  # a restart on the same store
    job = second.get(f"/jobs/{job_id}").json()
    assert (job["state"], job["done"], job["total"], job["result"]) == ("done", 3, 3, {"answer": 42})
    assert job["finished_at"] >= job["started_at"] >= job["created_at"]


def test_a_restart_marks_running_jobs_interrupted_and_runs_queued_ones(serve, db_url: str) -> None:
    with Store(db_url) as store:
        store.add_job(JobRecord(id="was-running", kind="verify", params={}, state="running", done=5, total=9,
                                owner=DEAD))
        store.add_job(JobRecord(id="was-queued", kind="verify", owner=DEAD,
                                params={"ops": ["masked_fill"], "stacks": [["vmap"]], "dtypes": ["float32"]}))
    client = serve()
    assert client.app.state.runner.recovered == (["was-running"], ["was-queued"])
    interrupted = client.get("/jobs/was-running").json()
    assert interrupted["state"] == "interrupted"
    assert interrupted["error"] == (f"interrupted: the server running it ({DEAD}) stopped before it finished, at "
                                    "5/9; submit it again")
    queued = _wait(client, "was-queued", timeout=300)
    assert queued["state"] == "done", queued
    assert queued["result"]["entries"] == queued["total"] > 0


def test_finished_jobs_are_pruned_after_the_retention(serve, db_url: str) -> None:
    old = time.time() - 100
    with Store(db_url) as store:
        store.add_job(JobRecord(id="old", kind="verify", params={}, state="done", owner=DEAD, finished_at=old))
        store.add_job(JobRecord(id="new", kind="verify", params={}, state="failed", owner=DEAD,
                                finished_at=time.time()))
        store.add_job(JobRecord(id="old-but-queued", kind="verify", params={}, state="cancelled", owner=DEAD,
                                finished_at=None))
    client = serve(job_retention_s=50)
    assert client.get("/jobs/old").status_code == 404
    assert client.get("/jobs/new").json()["state"] == "failed"
    assert client.get("/jobs/old-but-queued").json()["state"] == "cancelled"


def test_kill_9_during_a_job_then_restart(db_url: str) -> None:
    """The issue's "done when": the job is reported interrupted, queued jobs run, the store passes its check."""
    url = db_url
    # The server's own runner, on PostgreSQL too (whose default is `multicomposite worker` processes).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": url, "MULTICOMPOSITE_JOBS": "in-process"}

    def start() -> tuple[subprocess.Popen, str]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                httpx.get(f"{base}/healthz", timeout=2)
                return server, base
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.3)

    server, base = start()
    try:
        slow = {"ops": ["masked_fill"], "workloads": ["vmap"], "batch_sizes": [4], "numels": [64],
                "min_run_time": 5}
        running = httpx.post(f"{base}/profiles", json=slow, timeout=10).json()["id"]
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/jobs/{running}", timeout=10).json()["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        quick = {"ops": ["masked_fill"], "workloads": ["vmap"], "batch_sizes": [2], "numels": [16],
                 "min_run_time": 0.01}
        queued = httpx.post(f"{base}/profiles", json=quick, timeout=10).json()["id"]
        os.kill(server.pid, signal.SIGKILL)
        server.wait(20)
        server, base = start()
        job = httpx.get(f"{base}/jobs/{running}", timeout=10).json()
        assert job["state"] == "interrupted"
        assert job["error"].startswith(f"interrupted: the server running it ({socket.gethostname()}:")
        deadline = time.monotonic() + 240
        while (state := httpx.get(f"{base}/jobs/{queued}", timeout=10).json()["state"]) in ("queued", "running"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert state == "done"
    finally:
        server.terminate()
        server.wait(20)
    with Store(url) as store:
        assert store.integrity_ok()
