"""Verification and profiling jobs, kept in the store: one at a time on a worker thread (benchmarks must not overlap),
from a bounded queue. A job that fails records its error; the server keeps serving.

Every change of state is a row update, so a job outlives the process: after a restart, the jobs a dead server was
running are marked ``interrupted`` with the reason, and its queued jobs run here. Cancelling a queued job frees its
slot at once. Finished jobs are deleted after ``retention_s``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from registry.store.db import JobRecord, Store, this_process

# A job's progress is written at most this often: verify reports per context, far faster than anyone polls.
PROGRESS_EVERY_S = 0.25
PRUNE_EVERY_S = 60.0

Job = JobRecord


class QueueFullError(Exception):
    """The queue is full: try again later."""


class JobTimeoutError(Exception):
    """A job ran past its wall-clock limit."""


class JobRunner:
    def __init__(self, run: Callable[[Job, Callable[[int, int], None]], dict[str, Any]], store: Store,
                 queue_size: int, timeout_s: float, retention_s: float) -> None:
        self._run = run
        self._store = store
        self._queue_size = queue_size
        self._timeout_s = timeout_s
        self._retention_s = retention_s
        self._owner = this_process()
        self._queue: deque[str] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.recovered: tuple[list[str], list[str]] = ([], [])  # (interrupted, adopted) ids at start

    def start(self) -> None:
        """Recover what a previous server left (interrupted / queued), prune, and start the worker."""
        interrupted, adopted = self._store.recover_jobs(self._owner)
        self.recovered = (interrupted, [job.id for job in adopted])
        with self._wake:
            self._queue.extend(job.id for job in adopted)
        self.prune()
        self._thread = threading.Thread(target=self._work, name="multicomposite-jobs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()

    def prune(self) -> int:
        return self._store.prune_jobs(time.time() - self._retention_s)

    def submit(self, kind: str, params: dict[str, Any]) -> Job:
        with self._wake:
            if len(self._queue) >= self._queue_size:
                raise QueueFullError
            job = Job(id=uuid.uuid4().hex, kind=kind, params=params, owner=self._owner)
            self._store.add_job(job)
            self._queue.append(job.id)
            self._wake.notify()
        return job

    def get(self, job_id: str) -> Job | None:
        return self._store.job(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job (its queue slot is free at once); a running or finished one is returned unchanged."""
        with self._wake:
            job = self._store.cancel_job(job_id)
            if job is not None and job.state == "cancelled" and job_id in self._queue:
                self._queue.remove(job_id)
        return job

    def states(self) -> dict[str, int]:
        return self._store.job_counts()

    def _next(self) -> str | None:
        with self._wake:
            while not self._queue and not self._stopping:
                self._wake.wait(PRUNE_EVERY_S)
                if not self._queue and not self._stopping:
                    self.prune()
            if self._stopping:
                return None
            return self._queue.popleft()

    def _work(self) -> None:
        while (job_id := self._next()) is not None:
            job = self._store.job(job_id)
            if job is None or job.state != "queued":
                continue
            started = time.monotonic()
            self._store.update_job(job.id, state="running", started_at=time.time())
            last_write = 0.0

            def progress(done: int, total: int, job: Job = job, started: float = started) -> None:
                nonlocal last_write
                job.done, job.total = done, total
                now = time.monotonic()
                if now - last_write >= PROGRESS_EVERY_S or done == total:
                    self._store.update_job(job.id, done=done, total=total)
                    last_write = now
                if now - started > self._timeout_s:
                    raise JobTimeoutError(f"job ran past its limit of {self._timeout_s:.0f} s")

            try:
                result = self._run(job, progress)
                self._store.update_job(job.id, state="done", result=result, done=job.done, total=job.total,
                                       finished_at=time.time())
            except Exception as error:  # a failed job records why; the worker and the server go on
                try:
                    self._store.update_job(job.id, state="failed", error=f"{type(error).__name__}: {error}",
                                           done=job.done, total=job.total, finished_at=time.time())
                except Exception:  # the store itself failed: nothing left to record into; keep serving
                    continue
