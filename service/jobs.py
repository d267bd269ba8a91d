"""Verification and profiling jobs: one at a time on a worker thread (benchmarks must not overlap), from a bounded
queue. A job that fails records its error; the server keeps serving."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class QueueFullError(Exception):
    """The queue is full: try again later."""


class JobTimeoutError(Exception):
    """A job ran past its wall-clock limit."""


@dataclass
class Job:
    id: str
    kind: str
    params: dict[str, Any]
    state: str = "queued"  # queued | running | done | failed | cancelled
    done: int = 0
    total: int = 0
    result: dict[str, Any] | None = None
    error: str | None = None
    created: float = field(default_factory=time.time)


class JobRunner:
    def __init__(self, run: Callable[[Job, Callable[[int, int], None]], dict[str, Any]], queue_size: int,
                 timeout_s: float) -> None:
        self._run = run
        self._timeout_s = timeout_s
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="multicomposite-jobs", daemon=True)
        self._thread.start()

    def submit(self, kind: str, params: dict[str, Any]) -> Job:
        job = Job(id=uuid.uuid4().hex, kind=kind, params=params)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None
        with self._lock:
            self._jobs[job.id] = job
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job; a running or finished one is returned unchanged."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and job.state == "queued":
                job.state = "cancelled"
            return job

    def states(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for job in self._jobs.values():
                counts[job.state] = counts.get(job.state, 0) + 1
            return counts

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job.state == "cancelled":
                continue
            job.state = "running"
            started = time.monotonic()

            def progress(done: int, total: int, job: Job = job, started: float = started) -> None:
                job.done, job.total = done, total
                if time.monotonic() - started > self._timeout_s:
                    raise JobTimeoutError(f"job ran past its limit of {self._timeout_s:.0f} s")

            try:
                job.result = self._run(job, progress)
                job.state = "done"
            except Exception as error:  # a failed job records why; the worker and the server go on
                job.error = f"{type(error).__name__}: {error}"
                job.state = "failed"
