"""``QueuedJobs``: the API's side of jobs on workers. With a PostgreSQL store, a submitted job goes to the
procrastinate queue of its device kind and runs on a ``multicomposite worker`` (``worker``); progress and results
are read back from the store's ``jobs`` table, which the workers write."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from registry.store.connection import StoreUnavailableError
from registry.store.job_store import FINISHED_JOB_STATES, JobStore
from registry.store.processes import this_process
from registry.store.workers import registered_kinds
from service.jobs.backend import PRUNE_EVERY_S, Job, QueueFullError
from service.jobs.kinds import DEFAULT_KIND, kind_device_type
from service.jobs.tasks import defer, ensure_queue_schema, make_app

if TYPE_CHECKING:
    import procrastinate


class QueuedJobs:
    """A ``JobBackend`` whose jobs run on workers."""

    where = "on any worker"

    def __init__(self, store: JobStore, queue_size: int, retention_s: float,
                 on_finished: Callable[[], None] = lambda: None) -> None:
        """``on_finished``: called when a read finds a job finished, so that the service's cached responses are
        dropped before a client that sees the job done reads the results (the watcher would notice only at its
        next poll)."""
        self._store = store
        self._queue_size = queue_size
        self._retention_s = retention_s
        self._on_finished = on_finished
        self._owner = this_process()
        self._app: procrastinate.App | None = None
        self._lock = threading.Lock()
        self._last_prune = 0.0

    def start(self) -> None:
        ensure_queue_schema(self._store.engine)
        self._app = make_app(self._store.url, sync=True)
        self._app.open()
        self.prune()

    def shutdown(self) -> None:
        if self._app is not None:
            self._app.close()
            self._app = None

    def prune(self) -> int:
        self._last_prune = time.monotonic()
        return self._store.prune_jobs(time.time() - self._retention_s)

    def submit(self, kind: str, params: dict[str, Any]) -> Job:
        if self._app is None:
            raise StoreUnavailableError("the job queue is not open (the service is starting or stopping)")
        device_kind = params.get("device_kind", DEFAULT_KIND)
        with self._lock:  # one submitter at a time in this process: the queue bound is checked, then kept
            if time.monotonic() - self._last_prune > PRUNE_EVERY_S:
                self.prune()
            if self._store.job_counts().get("queued", 0) >= self._queue_size:
                raise QueueFullError
            job = Job(id=uuid.uuid4().hex, kind=kind, params=params, owner=self._owner)
            self._store.add_job(job)
        try:
            defer(self._app, job.id, device_kind)
        except Exception as error:  # the queue refused it: the job row says why, the caller gets a 503
            reason = f"the job could not be queued: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            self._store.update_job(job.id, state="failed", error=reason, finished_at=time.time())
            raise StoreUnavailableError(reason) from error
        return job

    def status(self, job_id: str) -> Job | None:
        job = self._store.job(job_id)
        if job is not None and job.state in FINISHED_JOB_STATES:
            self._on_finished()
        return job

    def cancel(self, job_id: str) -> Job | None:
        """A queued job at once: its procrastinate job stays queued and ends when a worker fetches it (the claim
        finds the row cancelled). A running one is marked ``cancelling``; its worker stops at its next progress
        write."""
        return self._store.cancel_job(job_id)

    def states(self) -> dict[str, int]:
        return self._store.job_counts()

    def device_kinds(self) -> tuple[str, ...]:
        """cpu and the kinds registered workers run: a job may wait for its worker, not for a kind nobody runs."""
        return tuple(dict.fromkeys((DEFAULT_KIND, *registered_kinds(self._store.engine))))

    def device_types(self) -> tuple[str, ...]:
        """A device type is available when a worker runs a kind of it."""
        return tuple(dict.fromkeys(kind_device_type(kind) for kind in self.device_kinds()))
