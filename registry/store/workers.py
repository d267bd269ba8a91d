"""The workers table: one row per running ``multicomposite worker`` process (``records.WorkerRecord``), and what is
read and written of it.

A row says which machine a worker runs on, the device kinds it takes jobs for, when it last beat and the store jobs
it runs now. ``heartbeat`` and ``started_at`` are the database server's clock (seconds since the epoch), so machines
whose clocks differ agree on who is stale. Workers run on PostgreSQL stores only (``func.now()`` is the server's
time there); the table is in every store's schema, made by the migrations (revision 0005) like every other table.

The table is defined on ``registry.store.tables``' metadata beside the others (the migrations' ``env.py`` imports this
module so that Alembic compares it too).
"""

from __future__ import annotations

import socket
from typing import Any

from sqlalchemy import Engine, delete, func, insert, select, update

from registry.store.job_store import ACTIVE_JOB_STATES, JobRow
from registry.store.records import WorkerRecord
from registry.store.tables import mapped_record

WorkerRow = mapped_record(WorkerRecord, "workers")


def _database_now() -> Any:
    return func.extract("epoch", func.now())


def register(engine: Engine, worker_id: str, pid: int, kinds: tuple[str, ...]) -> None:
    """Write worker ``worker_id``'s row afresh (a row of the same id left behind is replaced)."""
    now = _database_now()
    with engine.begin() as conn:
        conn.execute(delete(WorkerRow).where(WorkerRow.id == worker_id))
        conn.execute(insert(WorkerRow).values(id=worker_id, host=socket.gethostname(), pid=pid,
                                                   kinds=",".join(kinds), current_job=None, started_at=now,
                                                   heartbeat=now))


def unregister(engine: Engine, worker_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(delete(WorkerRow).where(WorkerRow.id == worker_id))


def beat(engine: Engine, worker_id: str, current_job: str | None) -> bool:
    """Refresh the heartbeat and the current jobs; False when the row is gone (reaped while the worker paused)."""
    with engine.begin() as conn:
        return bool(conn.execute(update(WorkerRow).where(WorkerRow.id == worker_id).values(
            heartbeat=_database_now(), current_job=current_job)).rowcount)


def set_current_job(engine: Engine, worker_id: str, current_job: str | None) -> None:
    with engine.begin() as conn:
        conn.execute(update(WorkerRow).where(WorkerRow.id == worker_id).values(current_job=current_job))


def registered_kinds(engine: Engine) -> tuple[str, ...]:
    """The device kinds that registered workers run, sorted."""
    with engine.connect() as conn:
        rows = conn.execute(select(WorkerRow.kinds)).scalars().all()
    return tuple(sorted({kind for row in rows for kind in row.split(",") if kind}))


def registered_workers(engine: Engine) -> list[dict[str, Any]]:
    """Registered workers, oldest first, with ``age_s``: seconds since their last heartbeat (database clock)."""
    query = select(WorkerRow, (_database_now() - WorkerRow.heartbeat).label("age_s")).order_by(
        WorkerRow.started_at, WorkerRow.id)
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]


def beat_within(engine: Engine, worker_id: str, seconds: float) -> bool:
    """Whether worker ``worker_id`` beat within the last ``seconds`` (database clock)."""
    cutoff = _database_now() - seconds
    with engine.connect() as conn:
        return conn.execute(select(WorkerRow.id).where(WorkerRow.id == worker_id,
                                                             WorkerRow.heartbeat >= cutoff)).first() is not None


def last_heartbeat(engine: Engine, worker_id: str) -> float | None:
    """When worker ``worker_id`` last beat (database clock), or None without its row."""
    with engine.connect() as conn:
        return conn.execute(select(WorkerRow.heartbeat).where(WorkerRow.id == worker_id)).scalar()


def prune_stale(engine: Engine, stale_after_s: float, keep: str) -> list[str]:
    """Delete the rows of workers (but ``keep``) whose heartbeat is older than ``stale_after_s`` (database clock)
    once no job they ran is left active; the ids deleted."""
    cutoff = _database_now() - stale_after_s
    still_running = select(JobRow.owner).where(JobRow.state.in_(ACTIVE_JOB_STATES))
    with engine.begin() as conn:
        return list(conn.execute(delete(WorkerRow).where(WorkerRow.heartbeat < cutoff,
                                                             WorkerRow.id != keep,
                                                             WorkerRow.id.not_in(still_running))
                                 .returning(WorkerRow.id)).scalars())
