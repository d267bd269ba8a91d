"""The jobs store: the service's verification, profiling and check jobs as the HTTP API shows them (what was asked,
where it stands, how it ended), their states, and the conditional writes that keep a job run once. The workers'
rows (``workers``) live beside them; the job queue itself (PostgreSQL) is procrastinate's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import and_, delete, func, insert, select, update
from sqlalchemy.engine import Row

from registry.store.database import Database

# The states live apart from the tables (job_states) so that the command line's --help lists them without SQLAlchemy.
from registry.store.job_states import ACTIVE_JOB_STATES as ACTIVE_JOB_STATES
from registry.store.job_states import FINISHED_JOB_STATES as FINISHED_JOB_STATES
from registry.store.job_states import JOB_STATES as JOB_STATES
from registry.store.processes import process_alive
from registry.store.records import JobRecord
from registry.store.tables import mapped_record

JobRow = mapped_record(JobRecord, "jobs")  # params and result are JSON text: the column type converts them


def job_from_row(row: Row[Any]) -> JobRecord:
    return JobRecord(**row._mapping)


class JobStore(Database):
    """The jobs in a SQL database (SQLite by default)."""

    def add_job(self, job: JobRecord) -> None:
        with self.writing() as conn:
            conn.execute(insert(JobRow), [vars(job)])

    def update_job(self, job_id: str, *, if_state: Iterable[str] | None = None, if_owner: str | None = None,
                   **values: Any) -> bool:
        """Write ``values`` into job ``job_id``'s row, only while its state is one of ``if_state`` and its owner is
        ``if_owner`` when given (a worker writes only the jobs it still runs); whether a row was written."""
        values["updated_at"] = time.time()
        query = update(JobRow).where(JobRow.id == job_id)
        if if_state is not None:
            query = query.where(JobRow.state.in_(list(if_state)))
        if if_owner is not None:
            query = query.where(JobRow.owner == if_owner)
        with self.writing() as conn:
            return bool(conn.execute(query.values(**values)).rowcount)

    def claim_job(self, job_id: str, owner: str) -> JobRecord | None:
        """``queued`` -> ``running`` for ``owner``, its count reset, in one statement: of workers fetching the same
        job (a job queued twice), one claims it; the job as claimed, or None if it was not queued (cancelled,
        finished, or taken)."""
        now = time.time()
        with self.writing() as conn:
            row = conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.state == "queued")
                               .values(state="running", owner=owner, started_at=now, updated_at=now, done=0, total=0)
                               .returning(JobRow)).first()
        return job_from_row(row) if row is not None else None

    def start_job(self, job_id: str, owner: str) -> JobRecord | None:
        """``queued`` -> ``running`` for ``owner``, in one statement (a cancel cannot slip in between the check and
        the write); the job as started, or None if it was not queued (cancelled, deleted, taken). A job ``owner``
        runs already counts as started: a retry after a commit whose outcome was unknown."""
        now = time.time()
        with self.writing() as conn:
            mine = and_(JobRow.state == "running", JobRow.owner == owner)
            conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.state == "queued")
                         .values(state="running", owner=owner, started_at=now, updated_at=now))
            row = conn.execute(select(JobRow).where(JobRow.id == job_id, mine)).first()
        return job_from_row(row) if row is not None else None

    def cancel_job(self, job_id: str) -> JobRecord | None:
        """Cancel ``job_id``: a queued one at once (one statement: a runner cannot start it in between), a running
        one is marked ``cancelling`` and its runner stops it at the next case boundary. Returns the job as it is
        now (None if there is none); a finished one is unchanged."""
        now = time.time()
        with self.writing() as conn:
            conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.state == "queued")
                         .values(state="cancelled", error="cancelled before it started", finished_at=now,
                                 updated_at=now))
            conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.state == "running")
                         .values(state="cancelling", updated_at=now))
        return self.job(job_id)

    def job(self, job_id: str) -> JobRecord | None:
        with self.reading() as conn:
            row = conn.execute(select(JobRow).where(JobRow.id == job_id)).first()
        return job_from_row(row) if row is not None else None

    def jobs(self, *, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Jobs, oldest first, optionally only in ``states``."""
        query = select(JobRow).order_by(JobRow.created_at, JobRow.id)
        if states is not None:
            query = query.where(JobRow.state.in_(list(states)))
        with self.reading() as conn:
            return [job_from_row(row) for row in conn.execute(query)]

    def job_counts(self) -> dict[str, int]:
        with self.reading() as conn:
            return {state: count for state, count in
                    conn.execute(select(JobRow.state, func.count()).group_by(JobRow.state))}

    def recover_jobs(self, owner: str) -> tuple[list[str], list[JobRecord]]:
        """After a restart: jobs left ``running`` by a process that is gone become ``interrupted`` (with the reason),
        ``cancelling`` ones ``cancelled``; ``queued`` jobs of a gone process pass to ``owner``. Returns (interrupted
        ids, queued jobs to run)."""
        now = time.time()
        interrupted, adopted = [], []
        with self.writing() as conn:
            # FOR UPDATE (PostgreSQL): two servers recovering at once do not both adopt a job.
            pending = select(JobRow).where(JobRow.state.in_(("queued", *ACTIVE_JOB_STATES))).with_for_update()
            for row in conn.execute(pending).all():
                job = job_from_row(row)
                if job.owner == owner or process_alive(job.owner):
                    continue
                if job.state == "cancelling":  # asked to stop, and it did: with its process
                    conn.execute(update(JobRow).where(JobRow.id == job.id).values(
                        state="cancelled", error=f"cancelled while running, at {job.done}/{job.total}",
                        finished_at=now, updated_at=now))
                elif job.state == "running":
                    reason = (f"interrupted: the server running it ({job.owner}) stopped before it finished, at "
                              f"{job.done}/{job.total}; submit it again")
                    conn.execute(update(JobRow).where(JobRow.id == job.id).values(
                        state="interrupted", error=reason, finished_at=now, updated_at=now))
                    interrupted.append(job.id)
                else:
                    conn.execute(update(JobRow).where(JobRow.id == job.id)
                                 .values(owner=owner, updated_at=now))
                    job.owner = owner
                    adopted.append(job)
        return interrupted, adopted

    def prune_jobs(self, finished_before: float) -> int:
        """Delete finished jobs (done, failed, cancelled, interrupted) that finished before ``finished_before``."""
        with self.writing() as conn:
            result = conn.execute(delete(JobRow).where(JobRow.state.in_(FINISHED_JOB_STATES),
                                                       JobRow.finished_at < finished_before))
        return result.rowcount or 0

    # Benchmarking runs -----------------------------------------------------------------------------------------
