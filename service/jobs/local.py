"""``LocalRunner``: the API process runs its jobs itself, kept in the store: one at a time on a thread (benchmarks
must not overlap), from a bounded queue. A job that fails records its error; the server keeps serving. The default
with a SQLite store.

Every change of state is a row update, so a job outlives the process: after a restart, the jobs a dead server was
running are marked ``interrupted`` with the reason, and its queued jobs run here. Cancelling a queued job frees its
slot at once; cancelling a running one marks it ``cancelling`` and it stops at the next case boundary (its next
progress report), ``cancelled``. Finished jobs are deleted after ``retention_s``.

The thread never dies of a store error: a job it could not start stays queued and is tried again; a progress write
the store refuses is skipped, and the write that ends a job is retried until the store takes it (``running``).

When the app stops (``shutdown``), a running job stops at its next case boundary, ``interrupted`` with the reason a
restart would give it, and the thread ends with the app: it does not run on beside the next app of the process, nor
into the interpreter's exit.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, NoReturn

from registry.store.job_store import ACTIVE_JOB_STATES, JobStore
from registry.store.processes import this_process
from service.jobs.backend import PRUNE_EVERY_S, Job, JobWork, QueueFullError
from service.jobs.kinds import detect_device_kinds
from service.jobs.running import JobCancelledError, ended, error_reason, is_store_error, progress_writer, until_stored

# How long shutdown waits for a running job to reach its next case boundary; past it the thread is left to end alone.
SHUTDOWN_WAIT_S = 10.0

log = logging.getLogger("multicomposite.jobs")


def _cancelled() -> NoReturn:
    raise JobCancelledError  # cancelled through another process: the store says cancelling


class RunnerStoppedError(Exception):
    """The runner stops (the app shuts down): raised from the job's progress report, at a case boundary."""


class LocalRunner:
    """A ``JobBackend`` whose jobs run on a thread of this process."""

    where = "on this host"

    def __init__(self, run: JobWork, store: JobStore, queue_size: int, timeout_s: float, retention_s: float) -> None:
        self._run = run
        self._store = store
        self._queue_size = queue_size
        self._timeout_s = timeout_s
        self._retention_s = retention_s
        self._owner = this_process()
        self._queue: deque[str] = deque()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancelled: set[str] = set()  # running jobs cancelled through this runner
        self.recovered: tuple[list[str], list[str]] = ([], [])  # (interrupted, adopted) ids at start

    def start(self) -> None:
        """Recover what a previous server left (interrupted / queued), prune, and start the thread."""
        interrupted, adopted = self._store.recover_jobs(self._owner)
        self.recovered = (interrupted, [job.id for job in adopted])
        with self._wake:
            self._queue.extend(job.id for job in adopted)
        self.prune()
        self._thread = threading.Thread(target=self._work, name="multicomposite-jobs", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stop.set()
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(SHUTDOWN_WAIT_S)

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

    def status(self, job_id: str) -> Job | None:
        return self._store.job(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """A queued job at once (its queue slot is free at once), a running one at its next case boundary
        (``cancelling`` until then); a finished one is returned unchanged."""
        with self._wake:
            job = self._store.cancel_job(job_id)
            if job is not None and job.state == "cancelled" and job_id in self._queue:
                self._queue.remove(job_id)
            if job is not None and job.state == "cancelling":
                self._cancelled.add(job_id)  # seen at the next progress report, without a read of the store
        return job

    def states(self) -> dict[str, int]:
        return self._store.job_counts()

    def device_kinds(self) -> tuple[str, ...]:
        return detect_device_kinds()

    def device_types(self) -> tuple[str, ...]:
        from service.validation import host_device_types

        return host_device_types()

    def _next(self) -> str | None:
        with self._wake:
            while not self._queue and not self._stop.is_set():
                self._wake.wait(PRUNE_EVERY_S)
                if not self._queue and not self._stop.is_set():
                    try:
                        self.prune()
                    except Exception as error:  # the store is away: prune at the next idle minute
                        if not is_store_error(error):
                            raise
            if self._stop.is_set():
                return None
            return self._queue.popleft()

    def _work(self) -> None:
        while (job_id := self._next()) is not None:
            try:
                self._run_one(job_id)
            except Exception:  # a bug in the runner itself: say so, and keep running the next jobs
                log.exception("job %s: the runner failed", job_id)

    def _run_one(self, job_id: str) -> None:
        job = until_stored(lambda: self._store.start_job(job_id, self._owner), "the job's start", job_id, self._stop,
                           log)
        if job is None:
            return  # not queued any more (cancelled, deleted), or the runner stops: it stays queued for the next
        report = progress_writer(
            job, write=lambda done, total: self._store.update_job(job.id, if_state=("running",), done=done,
                                                                  total=total),
            not_running=_cancelled, timeout_s=self._timeout_s, log=log, cancelled=lambda: job.id in self._cancelled)

        def progress(done: int, total: int) -> None:
            if self._stop.is_set():
                job.done, job.total = done, total
                raise RunnerStoppedError
            report(done, total)

        try:
            end = ended(job, result=self._run(job, progress))
        except RunnerStoppedError:
            end = {"state": "interrupted", "error": f"interrupted: the server running it ({self._owner}) stopped "
                   f"before it finished, at {job.done}/{job.total}; submit it again", "done": job.done,
                   "total": job.total, "finished_at": time.time()}
        except Exception as error:
            end = ended(job, error)
        finally:
            self._cancelled.discard(job.id)
        try:
            until_stored(lambda: self._store.update_job(job.id, if_state=ACTIVE_JOB_STATES, **end),
                         f"the job's end ({end['state']})", job.id, self._stop, log)
        except Exception as error:  # not the store's refusal: the end cannot be written as is (a result that is
            # not JSON); it fails with that reason instead
            failed = {"state": "failed", "error": f"its result could not be stored: {error_reason(error)}",
                      "done": job.done, "total": job.total, "finished_at": time.time()}
            until_stored(lambda: self._store.update_job(job.id, if_state=ACTIVE_JOB_STATES, **failed),
                         "the job's end (failed)", job.id, self._stop, log)
