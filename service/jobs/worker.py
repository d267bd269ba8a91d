"""``Worker``: one ``multicomposite worker`` process on a PostgreSQL store. It registers the device kinds it has
(its row in the store's ``workers`` table), runs the jobs of their procrastinate queues one at a time, beats, and
reaps other workers' stalled jobs (``reaper``).

A worker claims the store row with a conditional update (``queued`` -> ``running``, owner = the worker), so a
cancelled job, or one another worker already runs, is never run twice; every later write of the row is conditional
on still owning it. Each worker beats (its row, and procrastinate's own heartbeat) every ``heartbeat_s``. Results
are never half written: a verify job's matrix entries and a profile job's timings are written in one transaction
when the job's work is done, then the job is marked done; a worker killed between the two leaves complete results
that the retry rewrites (an upsert on the same keys).

With SQLite nothing here runs: the service's own runner (``local``) stays the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy.engine import make_url

from registry.store import workers as worker_rows
from registry.store.connection import StoreUnavailableError
from registry.store.db import Store
from registry.store.job_store import ACTIVE_JOB_STATES
from registry.store.records import JobRecord
from service.jobs.backend import JobWork
from service.jobs.kinds import DEFAULT_KIND, queue_for
from service.jobs.reaper import Reaper
from service.jobs.running import (
    JobCancelledError,
    ended,
    error_reason,
    is_store_error,
    progress_writer,
    until_stored,
)
from service.jobs.tasks import TASK_NAME, ensure_queue_schema, is_postgres, make_app

if TYPE_CHECKING:
    import procrastinate

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a graceful stop: the running job finishes, the row is removed
NEEDS_POSTGRES = ("workers need a PostgreSQL store: set MULTICOMPOSITE_DB=postgresql+psycopg://USER@HOST/DB (with "
                  "SQLite, `multicomposite serve` runs jobs itself)")

log = logging.getLogger("multicomposite.worker")


class WorkerSetupError(Exception):
    """The worker cannot start as asked: the message is one line saying what to change."""


class JobLostError(Exception):
    """This worker no longer owns the job (it was reaped as stale while it ran): stop without writing it."""


@dataclass(frozen=True)
class WorkerOptions:
    url: str
    kinds: tuple[str, ...]
    heartbeat_s: float = 5.0
    stale_after_s: float = 30.0
    max_attempts: int = 2
    timeout_s: float = 600.0


class Worker:
    """One ``multicomposite worker`` process: registers its kinds, runs the jobs of their queues one at a time,
    beats, reaps."""

    def __init__(self, options: WorkerOptions, execute: JobWork | None = None) -> None:
        if not is_postgres(options.url):
            raise WorkerSetupError(NEEDS_POSTGRES)
        self.options = options
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        try:
            self.store = Store(options.url)  # refused below the schema's head: `multicomposite db upgrade` first
            self.store.check()
            ensure_queue_schema(self.store.engine)
        except StoreUnavailableError as error:
            raise WorkerSetupError(str(error)) from None
        except Exception as error:  # any driver error: the server is down, the database or role is missing
            first = (str(error).strip().splitlines() or [""])[0]
            raise WorkerSetupError(f"the store at {make_url(options.url).render_as_string()} cannot be opened: "
                                   f"{type(error).__name__}: {first}") from None
        if execute is None:
            from service.jobs.work import make_job_work

            execute = make_job_work(self.store)
        self._execute = execute
        self.reaper = Reaper(self.store, self.id, heartbeat_s=options.heartbeat_s,
                             stale_after_s=options.stale_after_s, max_attempts=options.max_attempts)
        self._running: set[str] = set()
        self._running_lock = threading.Lock()
        self._reachable_since: float | None = None  # monotonic time of the first beat after the last failed one
        self._stop_requested = threading.Event()  # a stop signal: writes the store refuses are not retried then

    # Registration and heartbeats (sync: called through asyncio.to_thread) --------------------------------------

    def register(self) -> None:
        worker_rows.register(self.store.engine, self.id, os.getpid(), self.options.kinds)

    def unregister(self) -> None:
        worker_rows.unregister(self.store.engine, self.id)

    def beat(self) -> None:
        """Refresh the heartbeat; a row reaped while this process was paused is written again."""
        if not worker_rows.beat(self.store.engine, self.id, self._current()):
            self.register()

    def _current(self) -> str | None:
        with self._running_lock:
            return " ".join(sorted(self._running)) or None

    def _set_running(self, job_id: str, running: bool) -> None:
        with self._running_lock:
            (self._running.add if running else self._running.discard)(job_id)
        worker_rows.set_current_job(self.store.engine, self.id, self._current())

    # One job (sync: procrastinate runs it in a thread) ---------------------------------------------------------

    def claim(self, job_id: str) -> JobRecord | None:
        """``queued`` -> ``running`` for this worker, in one statement; None if the job is not queued (cancelled,
        finished, or already taken)."""
        return self.store.claim_job(job_id, self.id)

    def _update_owned(self, job_id: str, states: tuple[str, ...] = ACTIVE_JOB_STATES, **values: Any) -> bool:
        """Write the job's row only while this worker runs it (in one of ``states``); False if it was taken away."""
        return self.store.update_job(job_id, if_state=states, if_owner=self.id, **values)

    def _until_stored(self, write: Callable[[], Any], what: str, job_id: str) -> Any:
        """``write()``, retried while the store is away (a server restarting, a network cut) until it is taken:
        the end of a job is never lost to an outage. Until then the job stays ``running`` and this worker beats
        (once the store answers), so no reaper takes it; a worker stopping while it waits raises the store's error,
        and leaves the job to the reaper."""
        return until_stored(write, what, job_id, self._stop_requested, log, raise_when_stopping=True)

    def _not_running(self, job_id: str) -> NoReturn:
        """A progress write found the row not running for this worker: cancelled (``cancelling``), or taken."""
        current = self.store.job(job_id)
        if current is not None and current.state == "cancelling" and current.owner == self.id:
            raise JobCancelledError
        raise JobLostError(f"job {job_id} was taken from worker {self.id}")

    def run_job(self, job_id: str) -> str:
        """Run store job ``job_id`` if it is still queued; returns what became of it (for the log)."""
        job = self._until_stored(lambda: self.claim(job_id), "the job's claim", job_id)
        if job is None:
            current = self._until_stored(lambda: self.store.job(job_id), "a read of the job", job_id)
            return f"skipped: {current.state if current is not None else 'deleted'}"
        self._until_stored(lambda: self._set_running(job_id, True), "the worker's current job", job_id)
        retried_after = job.error  # the reaper's reason, when this is a retry
        progress = progress_writer(
            job, write=lambda done, total: self._update_owned(job_id, ("running",), done=done, total=total),
            not_running=lambda: self._not_running(job_id), timeout_s=self.options.timeout_s, log=log)
        try:
            result = self._execute(job, progress)
            result = {**result, "worker": self.id, "device_kind": job.params.get("device_kind", DEFAULT_KIND)}
            if retried_after:
                result["retried_after"] = retried_after
            end = ended(job, result=result)
        except JobLostError:
            return "lost: reaped while running"
        except Exception as error:  # a failed job records why; the worker goes on
            end = ended(job, error)
        finally:
            try:
                self._set_running(job_id, False)
            except Exception as error:  # the next beat writes the current job again
                if not is_store_error(error):
                    raise
        if not self._until_stored(lambda: self._update_owned(job_id, **end), f"the job's end ({end['state']})",
                                  job_id):
            return f"lost: reaped before it was marked {end['state']}"
        return str(end["state"])

    # The process ---------------------------------------------------------------------------------------------------

    async def _beat_and_reap(self, app: procrastinate.App) -> None:
        while True:
            try:
                await asyncio.to_thread(self.beat)
                if self._reachable_since is None:
                    self._reachable_since = time.monotonic()
                await self.reaper.reap(app, self._reachable_since)
            except Exception as error:  # the store is briefly unreachable: beat again at the next tick
                if is_store_error(error):
                    self._reachable_since = None
                    log.warning("heartbeat or reap failed (%s); trying again in %s s", error_reason(error),
                                self.options.heartbeat_s)
                else:
                    log.exception("heartbeat or reap failed; trying again in %s s", self.options.heartbeat_s)
            await asyncio.sleep(self.options.heartbeat_s)

    async def run_async(self) -> None:
        app = make_app(self.options.url, sync=False)

        def run_job_task(job_id: str) -> None:
            outcome = self.run_job(job_id)
            log.info("job %s: %s", job_id, outcome)

        app.task(name=TASK_NAME)(run_job_task)
        queues = [queue_for(kind) for kind in self.options.kinds]
        # Our own SIGTERM/SIGINT handlers from before the row is written: with procrastinate's, installed only once its
        # worker runs, a stop arriving in between killed the process and left its row behind. A stop cancels the
        # worker task, which procrastinate turns into a graceful stop (the running job finishes first).
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop.set)
        try:
            async with app.open_async():
                await asyncio.to_thread(self.register)
                beating = asyncio.create_task(self._beat_and_reap(app), name="multicomposite-heartbeat")
                work = asyncio.create_task(app.run_worker_async(
                    queues=queues, name=self.id, concurrency=1, wait=True,
                    update_heartbeat_interval=self.options.heartbeat_s,
                    stalled_worker_timeout=self.options.stale_after_s, install_signal_handlers=False),
                    name="multicomposite-worker")
                stopping = asyncio.create_task(stop.wait(), name="multicomposite-stop")
                try:
                    await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    if not work.done():
                        log.info("worker %s: stop requested; finishing the running job first", self.id)
                        self._stop_requested.set()
                        work.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await work  # a failure of the worker itself is raised here
                finally:
                    stopping.cancel()
                    beating.cancel()
                    await asyncio.to_thread(self.unregister)
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    def run(self) -> None:
        asyncio.run(self.run_async())
