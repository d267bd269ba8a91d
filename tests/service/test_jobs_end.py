"""Issue 20: a job always ends, and a running job can be cancelled.

Defect 2: when a job's progress write and its failure write both failed (the store locked by another process), the
job stayed ``running`` forever; a store error outside the ``try`` (reading the job, marking it running) killed the
runner's thread, and every later job stayed ``queued``. Now a refused progress write is skipped, the write that ends
a job is retried until the store takes it, and a job the runner could not start stays queued until it can.

Part of defect 3: DELETE /jobs/{id} on a running job was 409; now it marks the job ``cancelling`` (202) and the
runner stops it at its next case boundary, ``cancelled``, with nothing of it written to the matrix.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from registry.store import connection
from registry.store.connection import StoreUnavailableError
from registry.store.db import Store
from service.jobs import running
from service.jobs.backend import Job

BODY = {"ops": ["masked_fill"], "stacks": ["vmap"]}


def _state(client: TestClient, job_id: str) -> dict[str, Any]:
    response = client.get(f"/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for(client: TestClient, job_id: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (job := _state(client, job_id))["state"] not in states:
        assert time.monotonic() < deadline, f"job {job_id} is {job['state']}, not {states}: {job}"
        time.sleep(0.02)
    return job


@pytest.fixture
def locking_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """A SQLite store whose writers give up after 0.1 s of waiting for a lock (30 s otherwise), and ``locked()``: a
    context in which another connection holds the write lock, as another process writing for a long time would."""
    monkeypatch.setattr(connection, "BUSY_TIMEOUT_MS", 100)
    monkeypatch.setattr(running, "RETRY_MAX_S", 0.5)
    path = tmp_path / "store.db"

    @contextmanager
    def locked() -> Iterator[None]:
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN EXCLUSIVE")  # in WAL mode: writers wait, readers read on
            yield
        finally:
            other.execute("ROLLBACK")
            other.close()

    yield locked


def test_a_job_whose_progress_and_failure_writes_are_refused_ends_failed_with_its_reason(
        serve, locking_store) -> None:
    client = serve()
    lock_taken, progressed = threading.Event(), threading.Event()

    def run(job: Job, progress: Callable[[int, int], None]) -> dict[str, Any]:
        progress(1, 3)
        progressed.set()
        assert lock_taken.wait(10)
        progress(2, 3)  # refused: skipped, the job goes on
        raise RuntimeError("the harness failed")

    client.app.state.runner._run = run
    job_id = client.post("/verify", json=BODY).json()["id"]
    assert progressed.wait(10)
    with locking_store():
        lock_taken.set()
        time.sleep(1.0)  # the failure write is refused, again and again
        job = _state(client, job_id)  # readers read on
        assert (job["state"], job["done"]) == ("running", 1)
    job = _wait_for(client, job_id, ("failed",), timeout=10)
    assert (job["error"], job["done"], job["total"]) == ("RuntimeError: the harness failed", 2, 3)
    assert job["finished_at"] is not None


def test_a_job_whose_end_is_refused_ends_done_once_the_store_takes_it(serve, locking_store) -> None:
    client = serve()
    lock_taken, progressed = threading.Event(), threading.Event()

    def run(job: Job, progress: Callable[[int, int], None]) -> dict[str, Any]:
        progress(1, 2)
        progressed.set()
        assert lock_taken.wait(10)
        progress(2, 2)  # refused
        return {"answer": 42}

    client.app.state.runner._run = run
    job_id = client.post("/verify", json=BODY).json()["id"]
    assert progressed.wait(10)
    with locking_store():
        lock_taken.set()
        time.sleep(1.0)
        assert _state(client, job_id)["state"] == "running"
    job = _wait_for(client, job_id, ("done",), timeout=10)
    assert (job["result"], job["done"], job["total"]) == ({"answer": 42}, 2, 2)


def test_a_job_that_cannot_be_started_stays_queued_and_runs_once_the_store_answers(
        serve, locking_store, monkeypatch: pytest.MonkeyPatch) -> None:
    client = serve()
    runner = client.app.state.runner
    runner._run = lambda job, progress: (progress(1, 1), {"ran": job.id})[1]
    store: Store = client.app.state.store_state.store
    refusals = []
    start_job = store.start_job

    def refusing(job_id: str, owner: str) -> Any:
        if len(refusals) < 2:  # the store is away twice, outside any try of the old runner
            refusals.append(job_id)
            raise StoreUnavailableError("the store at ... cannot be read: OperationalError: disk I/O error")
        return start_job(job_id, owner)

    monkeypatch.setattr(store, "start_job", refusing)
    first = client.post("/verify", json=BODY).json()["id"]
    assert _wait_for(client, first, ("done",), timeout=10)["result"] == {"ran": first}
    assert refusals == [first, first]
    # Locked for real while the next one is submitted: it waits queued, then runs.
    with locking_store():
        second = client.post("/verify", json=BODY)  # the insert waits 0.1 s for the lock, then 503
        assert second.status_code == 503
        assert "database is locked" in second.json()["detail"]
    second = client.post("/verify", json=BODY).json()["id"]
    assert _wait_for(client, second, ("done",), timeout=10)["result"] == {"ran": second}
    assert runner._thread.is_alive()


def _stepping_run(reached: threading.Event, proceed: threading.Event,
                  cases: int = 10) -> Callable[[Job, Callable[[int, int], None]], dict[str, Any]]:
    def run(job: Job, progress: Callable[[int, int], None]) -> dict[str, Any]:
        for case in range(1, cases + 1):
            progress(case, cases)  # a case boundary
            reached.set()
            assert proceed.wait(10)
            time.sleep(running.PROGRESS_EVERY_S)  # each report is written
        return {"cases": cases}

    return run


def test_a_running_job_is_cancelled_at_its_next_case_boundary(serve) -> None:
    client = serve()
    reached, proceed = threading.Event(), threading.Event()
    client.app.state.runner._run = _stepping_run(reached, proceed)
    job_id = client.post("/verify", json=BODY).json()["id"]
    assert reached.wait(10)
    response = client.delete(f"/jobs/{job_id}")
    assert (response.status_code, response.json()["state"]) == (202, "cancelling")
    assert _state(client, job_id)["state"] == "cancelling"
    proceed.set()
    job = _wait_for(client, job_id, ("cancelled",), timeout=10)
    assert (job["done"], job["total"], job["result"]) == (2, 10, None)
    assert job["error"] == "cancelled while running, at 2/10"
    again = client.delete(f"/jobs/{job_id}")  # cancelled already: said again, nothing changes
    assert (again.status_code, again.json()) == (200, job)


def test_a_job_cancelled_through_the_store_by_another_process_stops_too(serve, db_url: str) -> None:
    client = serve()
    reached, proceed = threading.Event(), threading.Event()
    client.app.state.runner._run = _stepping_run(reached, proceed)
    job_id = client.post("/verify", json=BODY).json()["id"]
    assert reached.wait(10)
    with Store(db_url) as other:  # another server on the same store: only the row tells the runner
        assert other.cancel_job(job_id).state == "cancelling"
    proceed.set()
    job = _wait_for(client, job_id, ("cancelled",), timeout=10)
    assert job["done"] < job["total"] == 10


def test_a_real_verify_job_cancelled_while_running_writes_no_entries(serve) -> None:
    client = serve()
    job_id = client.post("/verify", json={"ops": ["masked_fill"], "dtypes": ["float32", "float64"]}).json()["id"]
    deadline = time.monotonic() + 120
    while (job := _state(client, job_id))["done"] == 0:
        assert job["state"] in ("queued", "running"), job
        assert time.monotonic() < deadline
        time.sleep(0.05)
    response = client.delete(f"/jobs/{job_id}")
    assert response.status_code == 202, response.text
    job = _wait_for(client, job_id, ("cancelled",), timeout=60)
    assert 0 < job["done"] < job["total"], job
    # The entries are written when the whole job's work is done: a cancelled job leaves none.
    assert client.get("/matrix", params={"op": "masked_fill"}).json()["items"] == []
