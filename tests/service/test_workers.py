"""Workers on a PostgreSQL store: the service enqueues through procrastinate, two ``multicomposite worker`` processes
share a sweep, one is SIGKILLed mid-job and its job is retried on the other with the reason; with SQLite the CLI
refuses to start a worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, insert, select, text

from registry.store import workers as worker_rows
from registry.store.db import Store
from registry.store.records import JobRecord
from registry.store.workers import WorkerRow
from service.cli import main
from service.jobs import running
from service.jobs.kinds import detect_device_kinds, queue_for, resolve_kind
from service.jobs.tasks import defer_async, make_app
from service.jobs.worker import Worker, WorkerOptions
from service.main import create_app
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"ops": ["masked_fill"], "stacks": ["vmap"], "dtypes": ["float32"]}
PROFILE = {"ops": ["masked_fill"], "workloads": ["vmap"], "batch_sizes": [8], "numels": [256], "dtypes": ["float32"],
           "min_run_time": 0.01}
# Long enough (a few seconds) to be killed in the middle of: 2 ops x 5 stacks, float32.
LONGER = {"ops": ["masked_fill", "index_add"], "stacks": ["vmap", "grad", "jvp", "vmap(grad)", "vmap(jvp)"],
          "dtypes": ["float32"]}
LONGER_STACKS = {("vmap",), ("grad",), ("jvp",), ("vmap", "grad"), ("vmap", "jvp")}


def _wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@pytest.fixture
def pg_store_url(postgres_url: str) -> str:
    """A new database on the session's PostgreSQL server (tests/conftest.py), as a SQLAlchemy URL."""
    return postgres_url


def _start_worker(url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MULTICOMPOSITE_DB": url}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--heartbeat", "0.5",
                                 "--stale-after", "2", *extra], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


@pytest.fixture
def two_workers(pg_store_url: str, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [_start_worker(pg_store_url, tmp_path / f"worker{n}.log") for n in (1, 2)]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for n in (1, 2):
            sys.stdout.write((tmp_path / f"worker{n}.log").read_text(errors="replace")[-3000:])


def _registered(url: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        return worker_rows.registered_workers(engine)
    except Exception:  # the table is not created yet: no worker has started
        return []
    finally:
        engine.dispose()


def test_two_workers_share_a_sweep_and_a_killed_workers_job_is_retried(
        pg_store_url: str, two_workers: list[subprocess.Popen[bytes]]) -> None:
    client = TestClient(create_app(Settings(db=pg_store_url, evidence_poll_s=0.05, queue_size=32)))
    with client:
        registered = _wait(lambda: len(rows := _registered(pg_store_url)) == 2 and rows, 300,
                           "both workers to register")
        assert sorted(row["pid"] for row in registered) == sorted(proc.pid for proc in two_workers)
        assert [row["kinds"] for row in registered] == ["cpu", "cpu"]

        # Kinds that no worker runs are refused, saying which there are.
        response = client.post("/profiles", json={**PROFILE, "device_kind": "cuda:X"})
        assert (response.status_code, response.json()) == (
            422, {"detail": "device kind 'cuda:X' is not available; device kinds: cpu"})
        response = client.post("/profiles", json={**PROFILE, "device": "cuda"})
        assert (response.status_code, response.json()) == (
            422, {"detail": "device 'cuda' is not on any worker; profile on cpu"})

        # A sweep of small jobs: both workers take some. (Verify only: a profile job runs the same code on a worker
        # as in process, and its noise re-measurements take minutes on a loaded machine.)
        ids = []
        for _ in range(6):
            response = client.post("/verify", json=SMALL)
            assert response.status_code == 202, response.text
            assert response.json()["state"] == "queued"
            assert response.json()["params"]["device_kind"] == "cpu"
            ids.append(response.json()["id"])
        finished = [_wait(lambda job_id=job_id: (job := client.get(f"/jobs/{job_id}").json())["state"] == "done"
                          and job, 300, f"job {job_id}") for job_id in ids]
        assert {job["result"]["worker"] for job in finished} == {row["id"] for row in registered}
        for job in finished:
            assert job["error"] is None
            assert job["result"]["device_kind"] == "cpu"
            assert job["done"] == job["total"] == job["result"]["entries"] == 20  # 5 composites x 4 patterns
        matrix = client.get("/matrix", params={"op": "masked_fill", "stack": "vmap", "limit": 1000}).json()
        assert len(matrix["items"]) == 20

        # One worker killed mid-job: the other retries it; the reason stays on the result.
        job_id = client.post("/verify", json=LONGER).json()["id"]
        running = _wait(lambda: (job := client.get(f"/jobs/{job_id}").json())["state"] == "running"
                        and job["done"] > 0 and job, 300, "the longer job to start")
        store = Store(pg_store_url, create=False)
        owner = store.job(job_id).owner
        victim = next(row for row in registered if row["id"] == owner)
        survivor = next(row for row in registered if row["id"] != owner)
        os.kill(victim["pid"], signal.SIGKILL)
        done = _wait(lambda: (job := client.get(f"/jobs/{job_id}").json())["state"] in ("done", "failed")
                     and job, 300, "the killed worker's job to be retried")
        assert done["state"] == "done", done
        assert done["error"] is None
        assert done["result"]["worker"] == survivor["id"]
        reason = done["result"]["retried_after"]
        assert reason.startswith(f"retry 2 of 2: worker {owner} stopped sending heartbeats while running this job "
                                 "(at ")
        assert "; none for over 2 s (last at " in reason
        assert running["done"] <= int(reason.split("(at ")[1].split("/")[0])
        # Complete and consistent: every (op, composite, stack, pattern) of the job is stored once, and no job is
        # left running or queued.
        assert done["done"] == done["total"] == done["result"]["entries"]
        stored = [e for op in LONGER["ops"] for e in store.entries(op=op) if e.stack in LONGER_STACKS]
        assert len(stored) == done["result"]["entries"]
        assert dict(Counter(e.status for e in stored)) == done["result"]["statuses"]
        assert {job.state for job in store.jobs()} == {"done"}
        # The dead worker's row is pruned; procrastinate's job ran twice and succeeded.
        _wait(lambda: [row["id"] for row in _registered(pg_store_url)] == [survivor["id"]], 30,
              "the dead worker's row to be pruned")
        with store.engine.connect() as conn:
            tasks = conn.execute(text("SELECT status, attempts, queue_name FROM procrastinate_jobs "
                                      "WHERE args->>'job_id' = :id"), {"id": job_id}).all()
        assert [tuple(row) for row in tasks] == [("succeeded", 2, "device-cpu")]
        store.close()


def test_concurrency_runs_that_many_worker_processes_and_a_sigterm_stops_them_all(pg_store_url: str,
                                                                                     tmp_path: Path) -> None:
    parent = _start_worker(pg_store_url, tmp_path / "parent.log", "--concurrency", "2")
    try:
        rows = _wait(lambda: len(found := _registered(pg_store_url)) == 2 and found, 300, "two worker rows")
        assert parent.pid not in {row["pid"] for row in rows}  # the children run the jobs, one each
        assert {row["kinds"] for row in rows} == {"cpu"}
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0
        assert _registered(pg_store_url) == []
        for row in rows:
            with pytest.raises(ProcessLookupError):
                os.kill(row["pid"], 0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# The reaper's and the claim's decisions, on the store directly (no worker process) ---------------------------------


@pytest.fixture
def worker_here(pg_store_url: str) -> Iterator[Worker]:
    def execute(job: JobRecord, progress: Callable[[int, int], None]) -> dict[str, Any]:
        progress(1, 2)
        progress(2, 2)
        return {"ran": job.id}

    made = Worker(WorkerOptions(url=pg_store_url, kinds=("cpu",), stale_after_s=2.0, max_attempts=2), execute)
    made.register()
    yield made
    made.store.close()


def _running(store: Store, job_id: str, owner: str) -> None:
    store.add_job(JobRecord(id=job_id, kind="verify", params={}, state="running", done=3, total=8, owner=owner))


def test_a_stale_workers_job_is_requeued_with_the_reason_then_failed_after_max_attempts(worker_here: Worker) -> None:
    store = worker_here.store
    _running(store, "first-run", "gone:1:abcdef")
    assert worker_here.reaper.requeue_or_fail("first-run", attempts=0) == "retry"
    job = store.job("first-run")
    assert (job.state, job.done, job.total, job.started_at) == ("queued", 0, 0, None)
    assert job.error == ("retry 2 of 2: worker gone:1:abcdef stopped sending heartbeats while running this job (at "
                         "3/8); none for over 2 s")

    _running(store, "second-run", "gone:2:abcdef")
    assert worker_here.reaper.requeue_or_fail("second-run", attempts=1) == "fail"
    job = store.job("second-run")
    assert job.state == "failed"
    assert job.error == ("worker gone:2:abcdef stopped sending heartbeats while running this job (at 3/8); none for "
                         "over 2 s; not retried: it ran 2 of max_attempts 2 times")
    assert job.finished_at is not None
    # Already final, or never claimed: the row is left as it is.
    assert worker_here.reaper.requeue_or_fail("second-run", attempts=1) == "finish"
    store.add_job(JobRecord(id="never-claimed", kind="verify", params={}))
    assert worker_here.reaper.requeue_or_fail("never-claimed", attempts=0) == "retry"
    assert store.job("never-claimed").state == "queued"
    assert worker_here.reaper.requeue_or_fail("no-such-job", attempts=0) == "finish"
    # Its own job, or one of a worker that beats in the workers table: procrastinate's heartbeat only lagged.
    _running(store, "mine", worker_here.id)
    assert worker_here.reaper.requeue_or_fail("mine", attempts=0) == "alive"
    with store.engine.begin() as conn:
        conn.execute(insert(WorkerRow).values(id="busy:5:abcdef", host="busy", pid=5, kinds="cpu",
                                                   started_at=func.extract("epoch", func.now()),
                                                   heartbeat=func.extract("epoch", func.now())))
    _running(store, "busy", "busy:5:abcdef")
    assert worker_here.reaper.requeue_or_fail("busy", attempts=0) == "alive"
    assert store.job("busy").state == store.job("mine").state == "running"


def test_the_reason_names_the_last_heartbeat_when_the_dead_workers_row_is_still_there(worker_here: Worker) -> None:
    store = worker_here.store
    with store.engine.begin() as conn:
        conn.execute(insert(WorkerRow).values(id="gone:3:abcdef", host="gone", pid=3, kinds="cpu",
                                                   started_at=1_000_000_000.0, heartbeat=1_000_000_000.0))
    _running(store, "stale", "gone:3:abcdef")
    # Its row stays while its job is still running: the reaper has not taken the job yet.
    assert worker_here.reaper.prune_stale_workers() == []
    assert worker_here.reaper.requeue_or_fail("stale", attempts=0) == "retry"
    assert store.job("stale").error.endswith("none for over 2 s (last at 2001-09-09 01:46:40 UTC)")
    assert worker_here.reaper.prune_stale_workers() == ["gone:3:abcdef"]
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(WorkerRow)).scalar() == 1  # this worker


def test_a_cancelled_job_is_skipped_and_a_job_taken_away_is_not_written(worker_here: Worker) -> None:
    store = worker_here.store
    store.add_job(JobRecord(id="cancelled", kind="verify", params={}))
    store.cancel_job("cancelled")
    assert worker_here.run_job("cancelled") == "skipped: cancelled"
    assert store.job("cancelled").state == "cancelled"

    store.add_job(JobRecord(id="ok", kind="verify", params={"device_kind": "cpu"}))
    assert worker_here.run_job("ok") == "done"
    job = store.job("ok")
    assert (job.state, job.done, job.total, job.owner) == ("done", 2, 2, worker_here.id)
    assert job.result == {"ran": "ok", "worker": worker_here.id, "device_kind": "cpu"}
    assert worker_here.run_job("ok") == "skipped: done"

    # Reaped while it ran (this worker looked dead): its progress write finds the row gone from it, and stops.
    def execute(job: JobRecord, progress: Callable[[int, int], None]) -> dict[str, Any]:
        store.update_job(job.id, state="queued", owner="", error="retry 2 of 2: ...")
        progress(1, 2)
        raise AssertionError("progress should have stopped the job")

    worker_here._execute = execute
    store.add_job(JobRecord(id="taken", kind="verify", params={}))
    assert worker_here.run_job("taken") == "lost: reaped while running"
    assert store.job("taken").state == "queued"
    with store.engine.connect() as conn:
        current = conn.execute(select(WorkerRow.current_job).where(WorkerRow.id == worker_here.id))
        assert current.scalar() is None


def test_a_running_job_cancelled_on_a_worker_stops_at_its_next_case_boundary(worker_here: Worker) -> None:
    """Issue 20: DELETE on a running job marks it cancelling in the store; the worker's next progress write finds
    it so and stops; a dead worker's cancelling job is cancelled by the reaper, not retried."""
    store = worker_here.store

    def execute(job: JobRecord, progress: Callable[[int, int], None]) -> dict[str, Any]:
        progress(1, 4)
        assert store.cancel_job(job.id).state == "cancelling"  # as DELETE /jobs/{id} from any server
        time.sleep(running.PROGRESS_EVERY_S)
        progress(2, 4)
        raise AssertionError("progress should have stopped the job")

    worker_here._execute = execute
    store.add_job(JobRecord(id="to-cancel", kind="verify", params={}))
    assert worker_here.run_job("to-cancel") == "cancelled"
    job = store.job("to-cancel")
    assert (job.state, job.done, job.total, job.error) == ("cancelled", 2, 4, "cancelled while running, at 2/4")

    store.add_job(JobRecord(id="cancelling", kind="verify", params={}, state="cancelling", done=1, total=4,
                            owner="gone:4:abcdef"))
    assert worker_here.reaper.requeue_or_fail("cancelling", attempts=0) == "finish"
    job = store.job("cancelling")
    assert (job.state, job.error) == ("cancelled", "cancelled while running, at 1/4 (its worker gone:4:abcdef "
                                                   "stopped)")


def test_a_worker_skips_refused_progress_writes_and_retries_the_end_until_stored(
        worker_here: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: with the store away for a while, a job on a worker ends all the same (it raised out of run_job and
    stayed running)."""
    from sqlalchemy.exc import OperationalError

    monkeypatch.setattr(running, "RETRY_FIRST_S", 0.01)
    store = worker_here.store
    update_owned = worker_here._update_owned
    refused: list[dict[str, Any]] = []

    def away(job_id: str, *args: Any, **values: Any) -> bool:
        if len(refused) < 3:  # the progress writes, and the first try of the end
            refused.append(values)
            raise OperationalError("UPDATE jobs ...", {}, Exception("server closed the connection unexpectedly"))
        return update_owned(job_id, *args, **values)

    monkeypatch.setattr(worker_here, "_update_owned", away)
    store.add_job(JobRecord(id="outage", kind="verify", params={"device_kind": "cpu"}))
    assert worker_here.run_job("outage") == "done"
    assert [values.get("state") for values in refused] == [None, None, "done"]
    job = store.job("outage")
    assert (job.state, job.done, job.total, job.result["ran"]) == ("done", 2, 2, "outage")


def test_a_job_whose_server_died_before_queueing_it_is_queued_again(worker_here: Worker) -> None:
    store = worker_here.store
    store.add_job(JobRecord(id="never-queued", kind="verify", params={"device_kind": "cpu"},
                            created_at=time.time() - 60))
    store.add_job(JobRecord(id="just-added", kind="verify", params={"device_kind": "cpu"}))
    store.add_job(JobRecord(id="on-the-queue", kind="verify", params={"device_kind": "cpu"},
                            created_at=time.time() - 60))

    async def orphaned() -> list[tuple[str, str]]:
        app = make_app(worker_here.options.url, sync=False)
        async with app.open_async():
            await defer_async(app, "on-the-queue", "cpu")  # procrastinate has it to do: not orphaned
            return await worker_here.reaper.orphaned_jobs(app)

    assert asyncio.run(orphaned()) == [("never-queued", "cpu")]


# Without a PostgreSQL server -----------------------------------------------------------------------------------------


def test_device_kinds_resolve_to_a_queue_or_say_what_to_send() -> None:
    assert queue_for("cpu") == "device-cpu"
    assert queue_for("cuda:NVIDIA H200") == "device-cuda-nvidia-h200"
    kinds = ("cpu", "cuda:NVIDIA H200")
    assert resolve_kind(None, "cpu", kinds) == "cpu"
    assert resolve_kind(None, "cuda", kinds) == "cuda:NVIDIA H200"
    assert resolve_kind("cuda:NVIDIA H200", "cuda", kinds) == "cuda:NVIDIA H200"
    with pytest.raises(ValueError, match=r"^several device kinds are of type 'cuda' \(cuda:A, cuda:B\); name one in "
                                         r"device_kind$"):
        resolve_kind(None, "cuda", ("cpu", "cuda:A", "cuda:B"))
    with pytest.raises(ValueError, match=r"^device kind 'cuda:X' is not available; device kinds: cpu$"):
        resolve_kind("cuda:X", "cuda", ("cpu",))
    with pytest.raises(ValueError, match=r"^device kind 'cpu' does not run device 'cuda'; send device 'cpu' with "
                                         r"it$"):
        resolve_kind("cpu", "cuda", kinds)
    with pytest.raises(ValueError, match=r"^device kind 'gpu' is not cpu or cuda:NAME"):
        queue_for("gpu")


def test_with_sqlite_profile_jobs_carry_this_hosts_device_kind(serve: Callable[..., TestClient]) -> None:
    client = serve()
    response = client.post("/profiles", json={"ops": ["masked_fill"], "device_kind": "cuda:X", "workloads": ["vmap"]})
    assert response.status_code == 422
    assert response.json() == {"detail": "device kind 'cuda:X' is not available; device kinds: cpu"}
    response = client.post("/verify", json=SMALL)
    assert response.status_code == 202
    assert response.json()["params"]["device_kind"] == "cpu"


def test_worker_command_refuses_bad_input_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    present = detect_device_kinds()
    assert main(["worker", "--device-kind", "cuda:Nope"]) == 2
    assert capsys.readouterr().err == (f"multicomposite worker: device kind 'cuda:Nope' is not on this machine; it "
                                       f"has {', '.join(present)}\n")
    assert main(["worker", "--heartbeat", "5", "--stale-after", "2"]) == 2
    assert capsys.readouterr().err == ("multicomposite worker: --heartbeat 5 must be below --stale-after 2, or every "
                                       "worker looks dead between two beats\n")
    # The tests' store is SQLite (tests/conftest.py).
    assert main(["worker"]) == 2
    assert capsys.readouterr().err == ("multicomposite worker: workers need a PostgreSQL store: set MULTICOMPOSITE_DB="
                                       "postgresql+psycopg://USER@HOST/DB (with SQLite, `multicomposite serve` runs "
                                       "jobs itself)\n")
    assert main(["worker", "--device-kind", "gpu"]) == 2
    assert "argument --device-kind: device kind 'gpu' is not cpu or cuda:NAME" in capsys.readouterr().err
    assert main(["worker", "--list-kinds"]) == 0
    assert capsys.readouterr().out == "".join(f"{kind}\n" for kind in present)
    assert present[0] == "cpu"


def test_a_worker_refuses_a_store_below_the_head_revision_saying_to_upgrade_it(postgres_empty_url: str) -> None:
    """The workers table is the migrations' (revision 0005), no longer made by a worker when it starts: a store at
    0004 is refused in one line until `multicomposite db upgrade`, and then the worker registers."""
    from registry.store import migrate
    from registry.store.database import safe_url
    from service.jobs.worker import WorkerSetupError

    migrate.upgrade(postgres_empty_url, "0004")
    with pytest.raises(WorkerSetupError) as refused:
        Worker(WorkerOptions(url=postgres_empty_url, kinds=("cpu",)))
    assert str(refused.value) == (
        f"the store at {safe_url(postgres_empty_url)} is at schema revision 0004, this multicomposite needs "
        f"{migrate.head()}; run `multicomposite db upgrade` with MULTICOMPOSITE_DB set to this store, then start again")
    migrate.upgrade(postgres_empty_url)
    worker = Worker(WorkerOptions(url=postgres_empty_url, kinds=("cpu",)))
    try:
        worker.register()
        assert [row["id"] for row in worker_rows.registered_workers(worker.store.engine)] == [worker.id]
    finally:
        worker.unregister()
        worker.store.close()
