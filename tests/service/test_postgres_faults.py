"""Issue 20, defect 6: a PostgreSQL store, two servers and two workers, under faults.

One test in phases, on a PostgreSQL server of its own: a worker killed (SIGKILL) in the middle of a job, a server
killed while it accepts jobs, then PostgreSQL itself killed and started again ~10 s later. Throughout: every job
ends (done, or failed with the reason; none stays queued or running), a job whose worker died is retried, no matrix
entry is written twice or half, the servers answer 503 while the store is away (liveness stays up) and answer again
on their own once it is back, and the workers go on without a restart.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from registry.core.stacks import split_stack
from registry.store.db import Store

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"ops": ["masked_fill"], "stacks": ["vmap"], "dtypes": ["float32"]}
# A few seconds of work on a worker: long enough to be killed, or to lose its store, in the middle of.
LONGER = {"ops": ["masked_fill", "index_add"], "stacks": ["vmap", "grad", "jvp", "vmap(grad)", "vmap(jvp)"],
          "dtypes": ["float32"]}
OUTAGE_S = 10.0


def _wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except httpx.TransportError:
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Server:
    """One ``multicomposite serve`` process (jobs go to the workers: the default with PostgreSQL)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.process: subprocess.Popen[bytes] | None = None
        self.base = ""

    def start(self) -> Server:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                                            cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        return self

    def ready(self) -> bool:
        return httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", params=params, timeout=15)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", json=body, timeout=15)

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _start_worker(url: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--heartbeat", "0.5",
                                 "--stale-after", "4"], cwd=ROOT, env={**os.environ, "MULTICOMPOSITE_DB": url},
                                stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def cluster(postgres_own_server: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    from registry.store.migrate import upgrade

    url = postgres_own_server.create_database()
    upgrade(url)
    env = {**os.environ, "MULTICOMPOSITE_DB": url, "MULTICOMPOSITE_EVIDENCE_POLL_S": "0.1"}
    servers = [Server(env, tmp_path / f"server{n}.log").start() for n in (1, 2)]
    workers = [_start_worker(url, tmp_path / f"worker{n}.log") for n in (1, 2)]
    made = {"url": url, "pg": postgres_own_server, "servers": servers, "workers": workers, "tmp": tmp_path}
    try:
        yield made
    finally:
        for server in servers:
            server.stop()
        for worker in made["workers"]:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in made["workers"]:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for log in sorted(tmp_path.glob("*.log")):
            sys.stdout.write(f"--- {log.name}\n{log.read_text(errors='replace')[-12000:]}\n")


def _job(servers: list[Server], job_id: str) -> dict[str, Any] | None:
    """The job as any server that answers says (each reads the same store)."""
    for server in servers:
        try:
            response = server.get(f"/jobs/{job_id}")
        except httpx.TransportError:
            continue
        if response.status_code == 200:
            return response.json()
    return None


def _ended(servers: list[Server], job_id: str, timeout: float) -> dict[str, Any]:
    return _wait(lambda: (job := _job(servers, job_id)) is not None and job["state"] in ("done", "failed",
                                                                                        "cancelled") and job,
                 timeout, f"job {job_id} to end")


def _registered(url: str, count: int) -> list[dict[str, Any]]:
    from sqlalchemy import create_engine

    from registry.store.workers import registered_workers

    engine = create_engine(url)
    try:
        rows = registered_workers(engine)
    except Exception:  # not created yet: no worker has started
        rows = []
    finally:
        engine.dispose()
    return rows if len(rows) == count else []


def test_two_servers_and_two_workers_through_kills_and_a_store_outage(cluster: dict[str, Any]) -> None:
    url, pg, servers = cluster["url"], cluster["pg"], cluster["servers"]
    _wait(lambda: all(server.ready() for server in servers), 120, "both servers")
    _wait(lambda: _registered(url, 2), 120, "both workers to register")
    jobs: list[str] = []

    # 1. A worker killed in the middle of a job: the other retries it, with the reason.
    response = servers[0].post("/verify", LONGER)
    assert response.status_code == 202, response.text
    longer = response.json()["id"]
    jobs.append(longer)
    running = _wait(lambda: (job := _job(servers, longer)) and job["state"] == "running" and job["done"] > 0
                    and job, 120, "the longer job to run")
    with Store(url, create=False) as store:
        owner = store.job(longer).owner
    victim = next(w for w in cluster["workers"] if owner.split(":")[1] == str(w.pid))
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(20)
    cluster["workers"].append(_start_worker(url, cluster["tmp"] / "worker3.log"))  # two workers again
    retried = _ended(servers, longer, 180)
    assert retried["state"] == "done", retried
    assert retried["result"]["retried_after"].startswith(f"retry 2 of 2: worker {owner} stopped sending heartbeats")
    assert running["done"] <= retried["done"] == retried["total"]

    # 2. A server killed while it accepts jobs: every job it accepted runs; the other server goes on.
    accepted: list[str] = []
    stop = threading.Event()

    def submit() -> None:
        while not stop.is_set():
            try:
                response = servers[1].post("/verify", SMALL)
            except httpx.TransportError:
                return
            if response.status_code == 202:
                accepted.append(response.json()["id"])

    submitter = threading.Thread(target=submit)
    submitter.start()
    _wait(lambda: len(accepted) >= 3, 60, "the second server to accept jobs")
    servers[1].kill()
    stop.set()
    submitter.join(30)
    jobs.extend(accepted)
    assert servers[0].ready()
    servers[1].start()
    _wait(servers[1].ready, 120, "the killed server to start again")

    # 3. PostgreSQL killed under a running job, and started again OUTAGE_S later.
    response = servers[0].post("/verify", LONGER)
    assert response.status_code == 202, response.text
    during = response.json()["id"]
    jobs.append(during)
    _wait(lambda: (job := _job(servers, during)) and job["state"] == "running" and job, 120,
          "a job to run before the outage")
    pg.kill()
    down = time.monotonic()
    for server in servers:
        answer = _wait(lambda server=server: (r := server.get("/readyz")).status_code == 503 and r, 30,
                       "a 503 while the store is away")
        assert answer.json()["detail"].startswith("the store at "), answer.text
        assert answer.headers["Retry-After"] == "5"
        assert server.get("/matrix").status_code == 503
        assert server.get("/healthz").json() == {"status": "ok"}
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
    pg.restart()
    for server in servers:
        _wait(server.ready, 30, "the server to answer again on its own")
    workers = [w for w in cluster["workers"] if w.poll() is None]
    assert len(workers) == 2, "a worker died of the outage"
    ended = _ended(servers, during, 180)
    # Done, or failed saying the store was away (its results then are not written at all).
    assert ended["state"] == "done" or "store" in (ended["error"] or ""), ended
    after = servers[1].post("/verify", SMALL)  # both servers queue jobs again
    assert after.status_code == 202, after.text
    jobs.append(after.json()["id"])

    # Every job ended; none is left queued or running; no entry is written twice or half.
    finished = {job_id: _ended(servers, job_id, 240) for job_id in jobs}
    assert all(job["state"] == "done" for job_id, job in finished.items() if job_id != during), finished
    with Store(url, create=False) as store:
        assert {job.state for job in store.jobs()} <= {"done", "failed"}, [(j.id, j.state) for j in store.jobs()]
        with store.engine.connect() as conn:
            twice = conn.execute(text("SELECT op, composite, stack, pattern, dtype, count(*) FROM matrix_entries "
                                      "GROUP BY op, composite, stack, pattern, dtype, device, torch_version "
                                      "HAVING count(*) > 1")).all()
        assert twice == []
        for job in finished.values():
            if job["state"] != "done":
                continue
            stacks = {tuple(split_stack(stack)) if isinstance(stack, str) else tuple(stack)
                      for stack in job["params"]["stacks"]}
            stored = [e for op in job["params"]["ops"] for e in store.entries(op=op) if e.stack in stacks
                      and e.dtype in job["params"]["dtypes"]]
            assert len(stored) == job["result"]["entries"], job
