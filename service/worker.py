"""Jobs on workers: with a PostgreSQL store, verify and profile jobs run on procrastinate workers, one process per
machine (``multicomposite worker``), each taking only the jobs aimed at the device kinds it has.

Why procrastinate: it keeps its queue in the PostgreSQL server that already holds the store (LISTEN/NOTIFY wakes the
workers, ``SELECT ... FOR UPDATE SKIP LOCKED`` hands each job to one of them), so a team adds no broker to run,
secure and back up. Celery, Dramatiq and RQ each need a Redis or RabbitMQ server beside the database.

The store's ``jobs`` table stays the record that the API and the dashboard read; procrastinate's job only carries
the store job's id to a worker of the right queue (``device-cpu``, ``device-cuda-nvidia-h200``, ...). A worker claims
the store row with a conditional update (``queued`` -> ``running``, owner = the worker), so a cancelled job, or one
another worker already runs, is never run twice; every later write of the row is conditional on still owning it.

Robustness: each worker beats (its row in ``workers``, and procrastinate's own heartbeat) every ``heartbeat_s``. Any
live worker reaps, one at a time (an advisory lock): a procrastinate job whose worker has sent no heartbeat for
``stale_after_s`` (killed, machine lost) has its store row put back to ``queued`` with the reason and is retried on
the same queue, or, once it has run ``max_attempts`` times, marked ``failed`` with the reason. Results are never half
written: a verify job's matrix entries and a profile job's timings are written in one transaction when the job's
work is done, then the job is marked done; a worker killed between the two leaves complete results that the retry
rewrites (an upsert on the same keys).

With SQLite nothing here runs: the service's in-process runner (``service/jobs.py``) stays the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, Engine, Float, Integer, MetaData, String, Table, Text, delete, func, select, text, update
from sqlalchemy.engine import make_url

from registry.store.db import (
    ACTIVE_JOB_STATES,
    FINISHED_JOB_STATES,
    JobRecord,
    Store,
    StoreUnavailableError,
    job_from_row,
    jobs_table,
)
from service.jobs import (
    PROGRESS_EVERY_S,
    PRUNE_EVERY_S,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    JobCancelledError,
    JobTimeoutError,
    QueueFullError,
    error_reason,
    is_store_error,
)

if TYPE_CHECKING:
    import procrastinate

    from service.jobs import Job

DEFAULT_KIND = "cpu"
TASK_NAME = "multicomposite.run_job"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a graceful stop: the running job finishes, the row is removed
QUEUE_PREFIX = "device-"
# What a device kind may be: cpu, or cuda: and the device's name as torch reports it ("cuda:NVIDIA H200").
_KIND = re.compile(r"^(cpu|cuda:[A-Za-z0-9 ._()+\-]{1,100})$")
# Advisory lock keys (any two fixed 64-bit numbers): one schema creation at a time, one reaper at a time.
_SCHEMA_LOCK = 0x6D635F736368656D
_REAP_LOCK = 0x6D635F7265617072
NEEDS_POSTGRES = ("workers need a PostgreSQL store: set MULTICOMPOSITE_DB=postgresql+psycopg://USER@HOST/DB (with "
                  "SQLite, `multicomposite serve` runs jobs itself)")

log = logging.getLogger("multicomposite.worker")

_metadata = MetaData()
# One row per running worker process: which machine, what it can run, when it last beat, what it runs now.
# ``heartbeat`` is the database server's clock (seconds since the epoch), so machines whose clocks differ agree.
workers_table = Table(
    "workers",
    _metadata,
    Column("id", String(300), primary_key=True),  # host:pid:suffix, also the owner of the jobs it runs
    Column("host", String(300), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("kinds", Text, nullable=False),  # device kinds, comma separated: cpu,cuda:NVIDIA H200
    Column("current_job", Text, nullable=True),  # the store job ids it runs now, space separated; NULL when idle
    Column("started_at", Float, nullable=False),
    Column("heartbeat", Float, nullable=False),
)


class WorkerSetupError(Exception):
    """The worker cannot start as asked: the message is one line saying what to change."""


class JobLostError(Exception):
    """This worker no longer owns the job (it was reaped as stale while it ran): stop without writing it."""


# Device kinds and queues ------------------------------------------------------------------------------------------


def detect_device_kinds() -> tuple[str, ...]:
    """``cpu``, and ``cuda:<name>`` for each CUDA device present (one kind per distinct name)."""
    import torch

    kinds = [DEFAULT_KIND]
    if torch.cuda.is_available():
        kinds.extend(f"cuda:{torch.cuda.get_device_name(index)}" for index in range(torch.cuda.device_count()))
    return tuple(dict.fromkeys(kinds))


def check_kind(kind: str) -> str:
    """``kind`` if well formed (cpu, or cuda:NAME), else ValueError saying what a kind looks like."""
    if not _KIND.match(kind):
        shown = kind if len(kind) <= 40 else kind[:37] + "..."
        raise ValueError(f"device kind {shown!r} is not cpu or cuda:NAME (NAME as torch.cuda.get_device_name "
                         "reports it, e.g. cuda:NVIDIA H200)")
    return kind


def queue_for(kind: str) -> str:
    """The procrastinate queue of a device kind: ``device-cpu``, ``device-cuda-nvidia-h200`` (a name that is safe as
    a LISTEN channel)."""
    return QUEUE_PREFIX + re.sub(r"[^a-z0-9]+", "-", check_kind(kind).lower()).strip("-")


def kind_device_type(kind: str) -> str:
    """``cpu`` or ``cuda``: the torch device type a kind runs on."""
    return kind.partition(":")[0]


def is_postgres(url: str | None) -> bool:
    return url is not None and make_url(url).get_backend_name() == "postgresql"


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://u:p@h/db`` (SQLAlchemy's) -> ``postgresql://u:p@h/db`` (libpq's, for procrastinate)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def ensure_schema(engine: Engine) -> None:
    """Create procrastinate's tables and the workers table if missing (one process at a time: a service and its
    workers starting together each try)."""
    from procrastinate.schema import SchemaManager

    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
        if conn.execute(text("SELECT to_regclass('procrastinate_jobs')")).scalar() is None:
            # Without parameters psycopg sends the script as is (several statements, % signs untouched).
            with conn.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(SchemaManager.get_schema())
        _metadata.create_all(conn)


def registered_kinds(engine: Engine) -> tuple[str, ...]:
    """The device kinds that registered workers run, sorted."""
    with engine.connect() as conn:
        rows = conn.execute(select(workers_table.c.kinds)).scalars().all()
    return tuple(sorted({kind for row in rows for kind in row.split(",") if kind}))


def workers(engine: Engine) -> list[dict[str, Any]]:
    """Registered workers, oldest first, with ``age_s``: seconds since their last heartbeat (database clock)."""
    now = func.extract("epoch", func.now())
    query = select(workers_table, (now - workers_table.c.heartbeat).label("age_s")).order_by(
        workers_table.c.started_at, workers_table.c.id)
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]


def available_kinds(store: Store, *, on_workers: bool) -> tuple[str, ...]:
    """Device kinds a job may be aimed at: with workers, cpu and the kinds registered workers run (a job may wait
    for its worker, not for a kind nobody runs); in process, the kinds of this host."""
    if on_workers:
        return tuple(dict.fromkeys((DEFAULT_KIND, *registered_kinds(store.engine))))
    return detect_device_kinds()


def resolve_kind(requested: str | None, device: str, available: Iterable[str]) -> str:
    """The device kind a job runs on: ``requested`` if available and of ``device``'s type; without it, cpu for a cpu
    job, and the one kind of ``device``'s type if there is exactly one. ValueError says what to send otherwise."""
    available = tuple(available)
    if requested is None:
        matching = [kind for kind in available if kind_device_type(kind) == device]
        if len(matching) == 1:
            return matching[0]
        if not matching:
            raise ValueError(f"no device kind of type {device!r} is available; device kinds: {', '.join(available)}")
        raise ValueError(f"several device kinds are of type {device!r} ({', '.join(matching)}); name one in "
                         "device_kind")
    check_kind(requested)
    if requested not in available:
        raise ValueError(f"device kind {requested!r} is not available; device kinds: {', '.join(available)}")
    if kind_device_type(requested) != device:
        raise ValueError(f"device kind {requested!r} does not run device {device!r}; send device "
                         f"{kind_device_type(requested)!r} with it")
    return requested


# The procrastinate app ----------------------------------------------------------------------------------------------


def make_app(url: str, *, sync: bool) -> procrastinate.App:
    """A procrastinate app on the store's server: sync for the service (defers from request threads), async for a
    worker (its event loop runs the jobs' threads, the heartbeats and the reaper)."""
    import procrastinate

    connector: Any = (procrastinate.SyncPsycopgConnector(conninfo=libpq_url(url)) if sync
                      else procrastinate.PsycopgConnector(conninfo=libpq_url(url)))
    return procrastinate.App(connector=connector)


def defer(app: procrastinate.App, job_id: str, kind: str) -> int:
    """Put store job ``job_id`` on the queue of ``kind``; returns procrastinate's job id."""
    return app.configure_task(name=TASK_NAME, queue=queue_for(kind)).defer(job_id=job_id)


# The service's side ------------------------------------------------------------------------------------------------


class QueuedJobs:
    """The service's job runner when the store is PostgreSQL: the same methods as ``service.jobs.JobRunner``, but a
    submitted job goes to procrastinate's queue for its device kind and runs on a worker; progress and results are
    read back from the store's jobs table, which the workers write."""

    def __init__(self, store: Store, queue_size: int, retention_s: float,
                 on_finished: Callable[[], None] = lambda: None) -> None:
        """``on_finished``: called when a read finds a job finished, so that the service's cached responses are
        dropped before a client that sees the job done reads the results (the watcher would notice only at its
        next poll)."""
        from registry.store.db import this_process

        self._store = store
        self._queue_size = queue_size
        self._retention_s = retention_s
        self._on_finished = on_finished
        self._owner = this_process()
        self._app: procrastinate.App | None = None
        self._lock = threading.Lock()
        self._last_prune = 0.0
        self.recovered: tuple[list[str], list[str]] = ([], [])  # workers recover jobs; the service has none

    def start(self) -> None:
        ensure_schema(self._store.engine)
        self._app = make_app(self._store.url, sync=True)
        self._app.open()
        self.prune()

    def stop(self) -> None:
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
            job = JobRecord(id=uuid.uuid4().hex, kind=kind, params=params, owner=self._owner)
            self._store.add_job(job)
        try:
            defer(self._app, job.id, device_kind)
        except Exception as error:  # the queue refused it: the job row says why, the caller gets a 503
            reason = f"the job could not be queued: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            self._store.update_job(job.id, state="failed", error=reason, finished_at=time.time())
            raise StoreUnavailableError(reason) from error
        return job

    def get(self, job_id: str) -> Job | None:
        job = self._store.job(job_id)
        if job is not None and job.state in FINISHED_JOB_STATES:
            self._on_finished()
        return job

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job. Its procrastinate job stays queued and ends at once when a worker fetches it: the
        claim finds the row cancelled."""
        return self._store.cancel_job(job_id)

    def states(self) -> dict[str, int]:
        return self._store.job_counts()


# The worker's side -------------------------------------------------------------------------------------------------


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

    def __init__(self, options: WorkerOptions,
                 execute: Callable[[Job, Callable[[int, int], None]], dict[str, Any]] | None = None) -> None:
        if not is_postgres(options.url):
            raise WorkerSetupError(NEEDS_POSTGRES)
        self.options = options
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        try:
            self.store = Store(options.url)
            self.store.check()
            ensure_schema(self.store.engine)
        except StoreUnavailableError as error:
            raise WorkerSetupError(str(error)) from None
        except Exception as error:  # any driver error: the server is down, the database or role is missing
            first = (str(error).strip().splitlines() or [""])[0]
            raise WorkerSetupError(f"the store at {make_url(options.url).render_as_string()} cannot be opened: "
                                   f"{type(error).__name__}: {first}") from None
        if execute is None:
            from service.job_work import make_job_runner

            execute = make_job_runner(self.store)
        self._execute = execute
        self._running: set[str] = set()
        self._running_lock = threading.Lock()
        self._app: procrastinate.App | None = None
        self._reachable_since: float | None = None  # monotonic time of the first beat after the last failed one
        self._stop_requested = threading.Event()  # a stop signal: writes the store refuses are not retried then

    # Registration and heartbeats (sync: called through asyncio.to_thread) --------------------------------------

    def register(self) -> None:
        now = func.extract("epoch", func.now())
        with self.store.engine.begin() as conn:
            conn.execute(delete(workers_table).where(workers_table.c.id == self.id))
            conn.execute(workers_table.insert().values(
                id=self.id, host=socket.gethostname(), pid=os.getpid(), kinds=",".join(self.options.kinds),
                current_job=None, started_at=now, heartbeat=now))

    def unregister(self) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(delete(workers_table).where(workers_table.c.id == self.id))

    def beat(self) -> None:
        """Refresh the heartbeat; a row reaped while this process was paused is written again."""
        with self.store.engine.begin() as conn:
            found = conn.execute(update(workers_table).where(workers_table.c.id == self.id).values(
                heartbeat=func.extract("epoch", func.now()), current_job=self._current())).rowcount
        if not found:
            self.register()

    def _current(self) -> str | None:
        with self._running_lock:
            return " ".join(sorted(self._running)) or None

    def _set_running(self, job_id: str, running: bool) -> None:
        with self._running_lock:
            (self._running.add if running else self._running.discard)(job_id)
        with self.store.engine.begin() as conn:
            conn.execute(update(workers_table).where(workers_table.c.id == self.id).values(
                current_job=self._current()))

    # One job (sync: procrastinate runs it in a thread) ---------------------------------------------------------

    def claim(self, job_id: str) -> JobRecord | None:
        """``queued`` -> ``running`` for this worker, in one statement; None if the job is not queued (cancelled,
        finished, or already taken)."""
        now = time.time()
        with self.store.engine.begin() as conn:
            row = conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "queued")
                               .values(state="running", owner=self.id, started_at=now, updated_at=now,
                                       done=0, total=0).returning(*jobs_table.c)).first()
        return job_from_row(row) if row is not None else None

    def _update_owned(self, job_id: str, states: tuple[str, ...] = ACTIVE_JOB_STATES, **values: Any) -> bool:
        """Write the job's row only while this worker runs it (in one of ``states``); False if it was taken away."""
        import json

        if values.get("result") is not None:
            values["result"] = json.dumps(values["result"])
        values["updated_at"] = time.time()
        with self.store.engine.begin() as conn:
            return bool(conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state.in_(states),
                                                         jobs_table.c.owner == self.id).values(**values)).rowcount)

    def _until_stored(self, write: Callable[[], Any], what: str, job_id: str) -> Any:
        """``write()``, retried while the store is away (a server restarting, a network cut) until it is taken:
        the end of a job is never lost to an outage. Until then the job stays ``running`` and this worker beats
        (once the store answers), so no reaper takes it; a worker killed while it waits leaves it to the reaper.
        Any error but the store's is raised."""
        delay = RETRY_FIRST_S
        while True:
            try:
                return write()
            except Exception as error:
                if not is_store_error(error) or self._stop_requested.is_set():
                    raise  # stopping: the row stays running, and the reaper retries the job once this worker is gone
                log.warning("job %s: the store refused %s (%s); retrying in %g s", job_id, what, error_reason(error),
                            delay)
            self._stop_requested.wait(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def run_job(self, job_id: str) -> str:
        """Run store job ``job_id`` if it is still queued; returns what became of it (for the log)."""
        job = self._until_stored(lambda: self.claim(job_id), "the job's claim", job_id)
        if job is None:
            current = self._until_stored(lambda: self.store.job(job_id), "a read of the job", job_id)
            return f"skipped: {current.state if current is not None else 'deleted'}"
        self._until_stored(lambda: self._set_running(job_id, True), "the worker's current job", job_id)
        retried_after = job.error  # the reaper's reason, when this is a retry
        started = time.monotonic()
        last_write = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal last_write
            job.done, job.total = done, total
            now = time.monotonic()
            if now - last_write >= PROGRESS_EVERY_S or done == total:
                last_write = now
                try:
                    running = self._update_owned(job_id, ("running",), done=done, total=total)
                except Exception as error:
                    if not is_store_error(error):
                        raise
                    # Progress is for watchers: the job goes on, the next report or the end writes it.
                    log.warning("job %s: progress %d/%d not written: %s", job_id, done, total, error_reason(error))
                else:
                    if not running:
                        current = self.store.job(job_id)
                        if current is not None and current.state == "cancelling" and current.owner == self.id:
                            raise JobCancelledError
                        raise JobLostError(f"job {job_id} was taken from worker {self.id}")
            if now - started > self.options.timeout_s:
                raise JobTimeoutError(f"job ran past its limit of {self.options.timeout_s:.0f} s")

        end: dict[str, Any]
        try:
            result = self._execute(job, progress)
            result = {**result, "worker": self.id, "device_kind": job.params.get("device_kind", DEFAULT_KIND)}
            if retried_after:
                result["retried_after"] = retried_after
            end = {"state": "done", "result": result, "error": None}
        except JobLostError:
            return "lost: reaped while running"
        except JobCancelledError:
            end = {"state": "cancelled", "error": f"cancelled while running, at {job.done}/{job.total}"}
        except Exception as error:  # a failed job records why; the worker goes on
            end = {"state": "failed", "error": error_reason(error) if is_store_error(error) else
                   f"{type(error).__name__}: {error}"}
        finally:
            try:
                self._set_running(job_id, False)
            except Exception as error:  # the next beat writes the current job again
                if not is_store_error(error):
                    raise
        end.update(done=job.done, total=job.total, finished_at=time.time())
        if not self._until_stored(lambda: self._update_owned(job_id, **end), f"the job's end ({end['state']})",
                                  job_id):
            return f"lost: reaped before it was marked {end['state']}"
        return str(end["state"])

    # Reaping stale workers' jobs -------------------------------------------------------------------------------

    def requeue_or_fail(self, job_id: str, attempts: int) -> str:
        """The store side of one stalled procrastinate job: 'retry' (row back to queued with the reason), 'fail'
        (row failed with the reason), 'finish' (the row is final already, or gone), or 'alive' (its worker is this
        one, or beat within ``stale_after_s`` in the workers table: procrastinate's heartbeat lagged, as it does
        on a loaded machine, and the job is left to run)."""
        job = self.store.job(job_id)
        if job is None or job.state in FINISHED_JOB_STATES:
            return "finish"
        if job.state == "queued":
            return "retry"  # fetched but never claimed: nothing ran
        if job.owner == self.id or self._beat_recently(job.owner):
            return "alive"
        if job.state == "cancelling":  # asked to stop, and its worker did: with its process
            with self.store.engine.begin() as conn:
                conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "cancelling",
                                                 jobs_table.c.owner == job.owner)
                             .values(state="cancelled", finished_at=time.time(), updated_at=time.time(),
                                     error=f"cancelled while running, at {job.done}/{job.total} (its worker "
                                           f"{job.owner} stopped)"))
            return "finish"
        runs = attempts + 1
        last = self._last_heartbeat(job.owner)
        why = (f"worker {job.owner} stopped sending heartbeats while running this job (at {job.done}/{job.total}); "
               f"none for over {self.options.stale_after_s:g} s{last}")
        now = time.time()
        if runs < self.options.max_attempts:
            values: dict[str, Any] = {"state": "queued", "error": f"retry {runs + 1} of {self.options.max_attempts}: "
                                      f"{why}", "done": 0, "total": 0, "started_at": None}
            outcome = "retry"
        else:
            values = {"state": "failed", "error": f"{why}; not retried: it ran {runs} of max_attempts "
                      f"{self.options.max_attempts} times", "finished_at": now}
            outcome = "fail"
        with self.store.engine.begin() as conn:
            changed = conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.state == "running",
                                                       jobs_table.c.owner == job.owner)
                                   .values(updated_at=now, **values)).rowcount
        return outcome if changed else "finish"

    def _beat_recently(self, owner: str) -> bool:
        """Whether worker ``owner`` beat within ``stale_after_s`` (database clock) in the workers table."""
        cutoff = func.extract("epoch", func.now()) - self.options.stale_after_s
        with self.store.engine.connect() as conn:
            return conn.execute(select(workers_table.c.id).where(workers_table.c.id == owner,
                                                                 workers_table.c.heartbeat >= cutoff)).first() \
                is not None

    def _last_heartbeat(self, owner: str) -> str:
        with self.store.engine.connect() as conn:
            beat = conn.execute(select(workers_table.c.heartbeat).where(workers_table.c.id == owner)).scalar()
        if beat is None:
            return ""
        return f" (last at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(beat))} UTC)"

    def prune_stale_workers(self) -> list[str]:
        """Delete the rows of workers whose heartbeat is older than ``stale_after_s`` (database clock) once no job
        they ran is left ``running``: until the reaper has taken their jobs, the row keeps their last heartbeat for
        the reason it writes (procrastinate's heartbeat, which decides when a job is stalled, may lag this one)."""
        cutoff = func.extract("epoch", func.now()) - self.options.stale_after_s
        still_running = select(jobs_table.c.owner).where(jobs_table.c.state.in_(ACTIVE_JOB_STATES))
        with self.store.engine.begin() as conn:
            return list(conn.execute(delete(workers_table).where(workers_table.c.heartbeat < cutoff,
                                                                 workers_table.c.id != self.id,
                                                                 workers_table.c.id.not_in(still_running))
                                     .returning(workers_table.c.id)).scalars())

    def orphaned_jobs(self) -> list[tuple[str, str]]:
        """Store jobs ``queued`` for over ``stale_after_s`` with no procrastinate job to run them: the server that
        accepted one was killed between writing its row and queueing it. (id, device kind) of each, to queue
        again; one queued twice is still run once (a worker's claim is conditional on ``queued``)."""
        import json

        cutoff = time.time() - max(self.options.stale_after_s, 2 * self.options.heartbeat_s)
        query = text("SELECT id, params FROM jobs WHERE state = 'queued' AND created_at < :cutoff AND NOT EXISTS "
                     "(SELECT 1 FROM procrastinate_jobs p WHERE p.args->>'job_id' = jobs.id "
                     "AND p.status IN ('todo', 'doing'))")
        with self.store.engine.connect() as conn:
            rows = conn.execute(query, {"cutoff": cutoff}).all()
        return [(row.id, json.loads(row.params).get("device_kind", DEFAULT_KIND)) for row in rows]

    async def reap(self) -> list[tuple[str, str]]:
        """One pass, unless another worker is reaping: returns (store job id, outcome) for each stalled job.

        Not while this worker has reached the store for less than ``stale_after_s`` since its last failed beat:
        when the store was away, no worker could beat, and their silence was the store's, not theirs."""
        from procrastinate.jobs import Status

        assert self._app is not None
        if self._reachable_since is None or time.monotonic() - self._reachable_since < self.options.stale_after_s:
            return []
        conn = await asyncio.to_thread(self.store.engine.connect)
        outcomes: list[tuple[str, str]] = []
        try:
            locked = await asyncio.to_thread(
                lambda: conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": _REAP_LOCK}).scalar())
            if not locked:
                return outcomes
            try:
                stalled = await self._app.job_manager.get_stalled_jobs(
                    task_name=TASK_NAME, seconds_since_heartbeat=self.options.stale_after_s)
                for stalled_job in stalled:
                    job_id = str(stalled_job.task_kwargs.get("job_id", ""))
                    outcome = await asyncio.to_thread(self.requeue_or_fail, job_id, stalled_job.attempts)
                    if outcome == "alive":
                        continue
                    if outcome == "retry":
                        await self._app.job_manager.retry_job(stalled_job)
                    else:
                        status = Status.FAILED if outcome == "fail" else Status.SUCCEEDED
                        await self._app.job_manager.finish_job(stalled_job, status=status, delete_job=False)
                    outcomes.append((job_id, outcome))
                    log.warning("job %s of a stalled worker: %s", job_id, outcome)
                for job_id, kind in await asyncio.to_thread(self.orphaned_jobs):
                    await self._app.configure_task(name=TASK_NAME, queue=queue_for(kind)).defer_async(job_id=job_id)
                    outcomes.append((job_id, "queued again"))
                    log.warning("job %s was never queued (its server stopped first): queued again", job_id)
                await asyncio.to_thread(self.prune_stale_workers)
            finally:
                await asyncio.to_thread(
                    lambda: conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _REAP_LOCK}))
        finally:
            await asyncio.to_thread(conn.close)
        return outcomes

    # The process ---------------------------------------------------------------------------------------------------

    async def _beat_and_reap(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.beat)
                if self._reachable_since is None:
                    self._reachable_since = time.monotonic()
                await self.reap()
            except Exception as error:  # the store is briefly unreachable: beat again at the next tick
                if is_store_error(error):
                    self._reachable_since = None
                    log.warning("heartbeat or reap failed (%s); trying again in %s s", error_reason(error),
                                self.options.heartbeat_s)
                else:
                    log.exception("heartbeat or reap failed; trying again in %s s", self.options.heartbeat_s)
            await asyncio.sleep(self.options.heartbeat_s)

    async def run_async(self) -> None:
        self._app = make_app(self.options.url, sync=False)

        def run_job_task(job_id: str) -> None:
            outcome = self.run_job(job_id)
            log.info("job %s: %s", job_id, outcome)

        self._app.task(name=TASK_NAME)(run_job_task)
        queues = [queue_for(kind) for kind in self.options.kinds]
        # Our own SIGTERM/SIGINT handlers from before the row is written: with procrastinate's, installed only once its
        # worker runs, a stop arriving in between killed the process and left its row behind. A stop cancels the
        # worker task, which procrastinate turns into a graceful stop (the running job finishes first).
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop.set)
        try:
            async with self._app.open_async():
                await asyncio.to_thread(self.register)
                beating = asyncio.create_task(self._beat_and_reap(), name="multicomposite-heartbeat")
                work = asyncio.create_task(self._app.run_worker_async(
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
