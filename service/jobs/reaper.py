"""``Reaper``: the jobs of workers that stopped beating. Any live worker reaps, one at a time (an advisory lock):
a procrastinate job whose worker has sent no heartbeat for ``stale_after_s`` (killed, machine lost) has its store row
put back to ``queued`` with the reason and is retried on the same queue, or, once it has run ``max_attempts`` times,
marked ``failed`` with the reason. A store job whose server stopped between writing its row and queueing it is
queued again. Dead workers' rows are pruned once their jobs are taken."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from registry.store import workers as worker_rows
from registry.store.job_store import FINISHED_JOB_STATES, JobStore
from service.jobs.kinds import DEFAULT_KIND
from service.jobs.tasks import TASK_NAME, defer_async

if TYPE_CHECKING:
    import procrastinate

# Advisory lock key (any fixed 64-bit number): one reaper at a time.
REAP_LOCK_KEY = 0x6D635F7265617072

log = logging.getLogger("multicomposite.worker")


class Reaper:
    """What worker ``worker_id`` does about other workers' stalled jobs."""

    def __init__(self, store: JobStore, worker_id: str, *, heartbeat_s: float, stale_after_s: float,
                 max_attempts: int) -> None:
        self.store = store
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.max_attempts = max_attempts

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
        if job.owner == self.worker_id or worker_rows.beat_within(self.store.engine, job.owner, self.stale_after_s):
            return "alive"
        if job.state == "cancelling":  # asked to stop, and its worker did: with its process
            self.store.update_job(job_id, if_state=("cancelling",), if_owner=job.owner, state="cancelled",
                                  finished_at=time.time(), error=f"cancelled while running, at {job.done}/{job.total} "
                                                                 f"(its worker {job.owner} stopped)")
            return "finish"
        runs = attempts + 1
        last = self._last_heartbeat(job.owner)
        why = (f"worker {job.owner} stopped sending heartbeats while running this job (at {job.done}/{job.total}); "
               f"none for over {self.stale_after_s:g} s{last}")
        now = time.time()
        if runs < self.max_attempts:
            values: dict[str, Any] = {"state": "queued", "error": f"retry {runs + 1} of {self.max_attempts}: {why}",
                                      "done": 0, "total": 0, "started_at": None}
            outcome = "retry"
        else:
            values = {"state": "failed", "error": f"{why}; not retried: it ran {runs} of max_attempts "
                      f"{self.max_attempts} times", "finished_at": now}
            outcome = "fail"
        changed = self.store.update_job(job_id, if_state=("running",), if_owner=job.owner, **values)
        return outcome if changed else "finish"

    def _last_heartbeat(self, owner: str) -> str:
        beat = worker_rows.last_heartbeat(self.store.engine, owner)
        if beat is None:
            return ""
        return f" (last at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(beat))} UTC)"

    def prune_stale_workers(self) -> list[str]:
        """Delete the rows of workers whose heartbeat is older than ``stale_after_s`` (database clock) once no job
        they ran is left running: until the reaper has taken their jobs, the row keeps their last heartbeat for the
        reason it writes (procrastinate's heartbeat, which decides when a job is stalled, may lag this one)."""
        return worker_rows.prune_stale(self.store.engine, self.stale_after_s, keep=self.worker_id)

    async def orphaned_jobs(self, app: procrastinate.App) -> list[tuple[str, str]]:
        """Store jobs ``queued`` for over ``stale_after_s`` with no procrastinate job to run them: the server that
        accepted one was killed between writing its row and queueing it. (id, device kind) of each, to queue
        again; one queued twice is still run once (a worker's claim is conditional on ``queued``).

        procrastinate's jobs to do or doing are listed first (its own ``list_jobs_async``), then the store's queued
        rows: a job that finishes in between was listed, so it is not taken for orphaned."""
        from procrastinate.jobs import Status

        waiting = {str(job.task_kwargs.get("job_id", ""))
                   for status in (Status.TODO, Status.DOING)
                   for job in await app.job_manager.list_jobs_async(task=TASK_NAME, status=status.value)}
        cutoff = time.time() - max(self.stale_after_s, 2 * self.heartbeat_s)
        queued = await asyncio.to_thread(self.store.jobs, states=("queued",))
        return [(job.id, job.params.get("device_kind", DEFAULT_KIND)) for job in queued
                if job.created_at < cutoff and job.id not in waiting]

    async def reap(self, app: procrastinate.App, reachable_since: float | None) -> list[tuple[str, str]]:
        """One pass, unless another worker is reaping: returns (store job id, outcome) for each stalled job.

        Not while this worker has reached the store for less than ``stale_after_s`` since its last failed beat
        (``reachable_since``, monotonic; None while it cannot): when the store was away, no worker could beat, and
        their silence was the store's, not theirs."""
        from procrastinate.jobs import Status

        if reachable_since is None or time.monotonic() - reachable_since < self.stale_after_s:
            return []
        conn = await asyncio.to_thread(self.store.engine.connect)
        outcomes: list[tuple[str, str]] = []
        try:
            locked = await asyncio.to_thread(
                lambda: conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": REAP_LOCK_KEY}).scalar())
            if not locked:
                return outcomes
            try:
                stalled = await app.job_manager.get_stalled_jobs(task_name=TASK_NAME,
                                                                 seconds_since_heartbeat=self.stale_after_s)
                for stalled_job in stalled:
                    job_id = str(stalled_job.task_kwargs.get("job_id", ""))
                    outcome = await asyncio.to_thread(self.requeue_or_fail, job_id, stalled_job.attempts)
                    if outcome == "alive":
                        continue
                    if outcome == "retry":
                        await app.job_manager.retry_job(stalled_job)
                    else:
                        status = Status.FAILED if outcome == "fail" else Status.SUCCEEDED
                        await app.job_manager.finish_job(stalled_job, status=status, delete_job=False)
                    outcomes.append((job_id, outcome))
                    log.warning("job %s of a stalled worker: %s", job_id, outcome)
                for job_id, kind in await self.orphaned_jobs(app):
                    await defer_async(app, job_id, kind)
                    outcomes.append((job_id, "queued again"))
                    log.warning("job %s was never queued (its server stopped first): queued again", job_id)
                await asyncio.to_thread(self.prune_stale_workers)
            finally:
                await asyncio.to_thread(
                    lambda: conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": REAP_LOCK_KEY}))
        finally:
            await asyncio.to_thread(conn.close)
        return outcomes
