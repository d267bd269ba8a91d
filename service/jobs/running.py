"""Running one job, the same for the API's own threads (``local``) and for a worker (``worker``): its progress
writes, the values that end it, and the writes retried while the store refuses them.

A job always ends: done, failed with the reason, or cancelled. A progress write the store refuses (locked by another
process, a server away) is skipped: progress is for watchers, and the next report or the end writes it. The write
that ends a job is retried until the store takes it. Only a process that stops first leaves a job ``running``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

from service.jobs.backend import Job, Progress

# A job's progress is written at most this often: verify reports per context, far faster than anyone polls.
PROGRESS_EVERY_S = 0.25
# While the store refuses a write that must happen (a job's start or end), it is retried (tenacity) after this many
# seconds, doubling up to the last.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0


class JobTimeoutError(Exception):
    """A job ran past its wall-clock limit."""


class JobCancelledError(Exception):
    """The job was cancelled while it ran: raised from its progress report, at a case boundary."""


def error_reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def is_store_error(error: BaseException) -> bool:
    """Whether ``error`` is the store refusing or losing a connection (worth retrying), not a bug."""
    from sqlalchemy.exc import DBAPIError

    from registry.store.connection import StoreUnavailableError

    return isinstance(error, StoreUnavailableError | DBAPIError)


def until_stored(write: Callable[[], Any], what: str, job_id: str, stop: threading.Event, log: logging.Logger, *,
                 raise_when_stopping: bool = False) -> Any:
    """``write()``, retried while the store refuses it, until it is taken; its value. Any error but the store's is
    raised. Once ``stop`` is set, it is not retried: None is returned (the job's row then says what the last write
    said, and a restart takes it from there), or with ``raise_when_stopping`` the store's error is raised (a worker's
    row stays running, and the reaper retries the job once the worker is gone). The waits between tries start at
    ``RETRY_FIRST_S`` and double up to ``RETRY_MAX_S``; a stop ends a wait at once."""
    def worth_retrying(error: BaseException) -> bool:
        return is_store_error(error) and not (raise_when_stopping and stop.is_set())

    def refused(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("job %s: the store refused %s (%s); retrying in %g s", job_id, what,
                    error_reason(error) if error is not None else "", delay)

    retrying = Retrying(retry=retry_if_exception(worth_retrying), reraise=True, before_sleep=refused,
                        wait=wait_exponential(multiplier=RETRY_FIRST_S, max=RETRY_MAX_S), sleep=stop.wait)
    for attempt in retrying:
        # A stop that ended the wait: no further try (a write could wait out SQLite's whole busy timeout).
        if attempt.retry_state.attempt_number > 1 and stop.is_set() and not raise_when_stopping:
            return None
        with attempt:
            return write()
    raise AssertionError("unreachable: Retrying either returns the write's value or raises its error")


def progress_writer(job: Job, *, write: Callable[[int, int], bool], not_running: Callable[[], NoReturn],
                    timeout_s: float, log: logging.Logger, cancelled: Callable[[], bool] = lambda: False) -> Progress:
    """The progress report ``job``'s work calls at each case boundary: it counts on ``job``, writes the count at most
    every PROGRESS_EVERY_S (and the last) with ``write(done, total)``, which says whether the job is still running
    (``not_running()`` raises otherwise), stops a job ``cancelled()`` says is cancelled, and one past ``timeout_s``."""
    started = time.monotonic()
    last_write = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last_write
        job.done, job.total = done, total
        if cancelled():
            raise JobCancelledError
        now = time.monotonic()
        if now - last_write >= PROGRESS_EVERY_S or done == total:
            last_write = now
            try:
                running = write(done, total)
            except Exception as error:
                if not is_store_error(error):
                    raise
                log.warning("job %s: progress %d/%d not written: %s", job.id, done, total, error_reason(error))
            else:
                if not running:
                    not_running()
        if now - started > timeout_s:
            raise JobTimeoutError(f"job ran past its limit of {timeout_s:.0f} s")

    return progress


def ended(job: Job, error: BaseException | None = None, result: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values that end ``job``'s row: done with ``result``, or (``error``) cancelled at its count, or failed
    with the reason; a failed job records why, and the process running it goes on."""
    end: dict[str, Any]
    if error is None:
        end = {"state": "done", "result": result, "error": None}
    elif isinstance(error, JobCancelledError):
        end = {"state": "cancelled", "error": f"cancelled while running, at {job.done}/{job.total}"}
    else:
        end = {"state": "failed", "error": error_reason(error) if is_store_error(error) else
               f"{type(error).__name__}: {error}"}
    return {**end, "done": job.done, "total": job.total, "finished_at": time.time()}
