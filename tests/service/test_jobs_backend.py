"""The job backends behind one protocol: each implements every member of ``JobBackend`` with its signature, and
the app picks one when it starts (in process with SQLite, workers with PostgreSQL, unless MULTICOMPOSITE_JOBS says
otherwise) and hands the routes that one; the in-process runner's thread ends with its app."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.jobs.backend import Job, JobBackend
from service.jobs.local import LocalRunner
from service.jobs.queue import QueuedJobs
from service.jobs.startup import job_backend
from service.main import create_app
from service.settings import Settings
from service.state import StoreState

MEMBERS = ("start", "shutdown", "submit", "status", "cancel", "states", "device_kinds", "device_types")


@pytest.mark.parametrize("backend", [LocalRunner, QueuedJobs])
def test_each_backend_implements_the_protocol_with_its_signatures(backend: type) -> None:
    protocol_members = {name for name in vars(JobBackend) if not name.startswith("_")} - {"where"}
    assert protocol_members == set(MEMBERS)
    for name in MEMBERS:
        assert inspect.signature(getattr(backend, name)) == inspect.signature(getattr(JobBackend, name)), name
    assert isinstance(backend.where, str)
    assert (LocalRunner.where, QueuedJobs.where) == ("on this host", "on any worker")


def _picked(url: str, jobs: str) -> type:
    state = StoreState(url, 1.0, 1)
    state.open()
    try:
        return type(job_backend(Settings(db=url, jobs=jobs), state))
    finally:
        state.close()


def test_sqlite_runs_jobs_in_process(db_url: str) -> None:
    assert _picked(db_url, "auto") is LocalRunner
    assert _picked(db_url, "in-process") is LocalRunner


def test_postgres_sends_jobs_to_workers_unless_told_in_process(postgres_url: str) -> None:
    assert _picked(postgres_url, "auto") is QueuedJobs
    assert _picked(postgres_url, "workers") is QueuedJobs
    assert _picked(postgres_url, "in-process") is LocalRunner


def test_with_no_worker_registered_a_job_may_aim_at_cpu_only(postgres_url: str) -> None:
    """A job may wait for its worker, not for a kind nobody runs: cpu is always a kind, others once registered."""
    from registry.store import workers as worker_rows

    state = StoreState(postgres_url, 1.0, 1)
    state.open()
    try:
        backend = job_backend(Settings(db=postgres_url), state)
        assert (backend.device_kinds(), backend.device_types()) == (("cpu",), ("cpu",))
        worker_rows.register(state.require().engine, "gpu-box:7:abcdef", 7, ("cpu", "cuda:NVIDIA H200"))
        assert (backend.device_kinds(), backend.device_types()) == (("cpu", "cuda:NVIDIA H200"), ("cpu", "cuda"))
    finally:
        state.close()


def test_the_routes_get_the_backend_the_app_started(serve: Callable[..., TestClient]) -> None:
    client = serve()
    backend = client.app.state.runner
    assert type(backend) is LocalRunner
    assert backend.device_kinds()[0] == "cpu"
    assert "cpu" in backend.device_types()
    response = client.post("/profiles", json={"ops": ["masked_fill"], "device": "nope", "workloads": ["vmap"]})
    assert response.status_code == 422
    assert response.json() == {"detail": f"device 'nope' is not on this host; profile on "
                                         f"{', '.join(backend.device_types())}"}


def test_a_job_running_when_the_app_stops_ends_interrupted_at_its_next_case_boundary(db_url: str) -> None:
    """The runner's thread ends with its app: it does not run on beside the next app of the process."""
    import threading

    from registry.store.db import Store
    from registry.store.processes import this_process

    reached, proceed = threading.Event(), threading.Event()

    def run(job: Job, progress: Callable[[int, int], None]) -> dict[str, Any]:
        progress(1, 4)
        reached.set()
        assert proceed.wait(10)
        progress(2, 4)  # the app stopped meanwhile: the job stops here
        raise AssertionError("progress should have stopped the job")

    with TestClient(create_app(Settings(db=db_url, jobs="in-process"))) as client:
        runner = client.app.state.runner
        runner._run = run
        job_id = client.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap"]}).json()["id"]
        assert reached.wait(10)
        threading.Timer(0.5, proceed.set).start()  # once shutdown waits for the thread
    assert not runner._thread.is_alive()
    with Store(db_url) as store:
        job = store.job(job_id)
    assert (job.state, job.done, job.total, job.result) == ("interrupted", 2, 4, None)
    assert job.error == (f"interrupted: the server running it ({this_process()}) stopped before it finished, at 2/4; "
                         "submit it again")
