"""Verification and profiling jobs, kept in the store: one at a time on a worker thread (benchmarks must not overlap),
from a bounded queue. A job that fails records its error; the server keeps serving.

Every change of state is a row update, so a job outlives the process: after a restart, the jobs a dead server was
running are marked ``interrupted`` with the reason, and its queued jobs run here. Cancelling a queued job frees its
slot at once; cancelling a running one marks it ``cancelling`` and it stops at the next case boundary (its next
progress report), ``cancelled``. Finished jobs are deleted after ``retention_s``.

A job always ends: done, failed with the reason, or cancelled. A progress write the store refuses (locked by another
process, a server away) is skipped; the write that ends a job is retried until the store takes it, and the worker
thread never dies of a store error: a job it could not start stays queued and is tried again. Only a process that
stops first leaves a job ``running``, and the next start marks it ``interrupted``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from registry.store.db import ACTIVE_JOB_STATES, JobRecord, Store, this_process

# A job's progress is written at most this often: verify reports per context, far faster than anyone polls.
PROGRESS_EVERY_S = 0.25
PRUNE_EVERY_S = 60.0
# While the store refuses a write that must happen (a job's start or end), it is retried after this many seconds,
# doubling up to the last.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0

Job = JobRecord
log = logging.getLogger("multicomposite.jobs")


class QueueFullError(Exception):
    """The queue is full: try again later."""


class JobTimeoutError(Exception):
    """A job ran past its wall-clock limit."""


class JobCancelledError(Exception):
    """The job was cancelled while it ran: raised from its progress report, at a case boundary."""


def error_reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


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
        self._cancelled: set[str] = set()  # running jobs cancelled through this runner
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
        """Cancel a job: a queued one at once (its queue slot is free at once), a running one at its next case
        boundary (``cancelling`` until then); a finished one is returned unchanged."""
        with self._wake:
            job = self._store.cancel_job(job_id)
            if job is not None and job.state == "cancelled" and job_id in self._queue:
                self._queue.remove(job_id)
            if job is not None and job.state == "cancelling":
                self._cancelled.add(job_id)  # seen at the next progress report, without a read of the store
        return job

    def states(self) -> dict[str, int]:
        return self._store.job_counts()

    def _next(self) -> str | None:
        with self._wake:
            while not self._queue and not self._stopping:
                self._wake.wait(PRUNE_EVERY_S)
                if not self._queue and not self._stopping:
                    try:
                        self.prune()
                    except Exception as error:  # the store is away: prune at the next idle minute
                        if not is_store_error(error):
                            raise
            if self._stopping:
                return None
            return self._queue.popleft()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the runner stops first; whether it is stopping."""
        with self._wake:
            if not self._stopping:
                self._wake.wait(seconds)
            return self._stopping

    def _until_stored(self, write: Callable[[], Any], what: str, job_id: str) -> Any:
        """``write()``, retried while the store refuses it, until it is taken or the runner stops; its value, or
        None when stopping (the job's row then says what the last write said, and a restart takes it from there).
        Any error but the store's is raised."""
        delay = RETRY_FIRST_S
        while True:
            try:
                return write()
            except Exception as error:
                if not is_store_error(error):
                    raise
                log.warning("job %s: the store refused %s (%s); retrying in %g s", job_id, what, error_reason(error),
                            delay)
            if self._pause(delay):
                return None
            delay = min(delay * 2, RETRY_MAX_S)

    def _work(self) -> None:
        while (job_id := self._next()) is not None:
            try:
                self._run_one(job_id)
            except Exception:  # a bug in the runner itself: say so, and keep running the next jobs
                log.exception("job %s: the runner failed", job_id)

    def _run_one(self, job_id: str) -> None:
        job = self._until_stored(lambda: self._store.start_job(job_id, self._owner), "the job's start", job_id)
        if job is None:
            return  # not queued any more (cancelled, deleted), or the runner stops: it stays queued for the next
        started = time.monotonic()
        last_write = 0.0

        def progress(done: int, total: int, job: Job = job, started: float = started) -> None:
            nonlocal last_write
            job.done, job.total = done, total
            if job.id in self._cancelled:
                raise JobCancelledError
            now = time.monotonic()
            if now - last_write >= PROGRESS_EVERY_S or done == total:
                last_write = now
                try:
                    running = self._store.update_job(job.id, if_state=("running",), done=done, total=total)
                except Exception as error:
                    if not is_store_error(error):
                        raise
                    # Progress is for watchers: the job goes on, the next report or the end writes it.
                    log.warning("job %s: progress %d/%d not written: %s", job.id, done, total, error_reason(error))
                else:
                    if not running:  # cancelled through another process (the store says cancelling)
                        raise JobCancelledError
            if now - started > self._timeout_s:
                raise JobTimeoutError(f"job ran past its limit of {self._timeout_s:.0f} s")

        end: dict[str, Any]
        try:
            result = self._run(job, progress)
            end = {"state": "done", "result": result, "error": None}
        except JobCancelledError:
            end = {"state": "cancelled", "error": f"cancelled while running, at {job.done}/{job.total}"}
        except Exception as error:  # a failed job records why; the worker and the server go on
            end = {"state": "failed", "error": error_reason(error) if is_store_error(error) else
                   f"{type(error).__name__}: {error}"}
        finally:
            self._cancelled.discard(job.id)
        end.update(done=job.done, total=job.total, finished_at=time.time())
        try:
            self._until_stored(lambda: self._store.update_job(job.id, if_state=ACTIVE_JOB_STATES, **end),
                               f"the job's end ({end['state']})", job.id)
        except Exception as error:  # not the store's refusal: the end cannot be written as is (a result that is
            # not JSON); it fails with that reason instead
            failed = {"state": "failed", "error": f"its result could not be stored: {error_reason(error)}",
                      "done": job.done, "total": job.total, "finished_at": time.time()}
            self._until_stored(lambda: self._store.update_job(job.id, if_state=ACTIVE_JOB_STATES, **failed),
                               "the job's end (failed)", job.id)


def is_store_error(error: BaseException) -> bool:
    """Whether ``error`` is the store refusing or losing a connection (worth retrying), not a bug."""
    from sqlalchemy.exc import DBAPIError

    from registry.store.db import StoreUnavailableError

    return isinstance(error, StoreUnavailableError | DBAPIError)
