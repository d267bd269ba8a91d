"""The procrastinate app on the store's PostgreSQL server, and its one task: run store job ``job_id``.

Why procrastinate: it keeps its queue in the PostgreSQL server that already holds the store (LISTEN/NOTIFY wakes the
workers, ``SELECT ... FOR UPDATE SKIP LOCKED`` hands each job to one of them), so a team adds no broker to run,
secure and back up. Celery, Dramatiq and RQ each need a Redis or RabbitMQ server beside the database.

procrastinate's job only carries the store job's id to a worker of the right queue (``device-cpu``,
``device-cuda-nvidia-h200``, ...); the store's ``jobs`` table stays the record the API and the dashboard read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from service.jobs.kinds import queue_for

if TYPE_CHECKING:
    import procrastinate

TASK_NAME = "multicomposite.run_job"
# Advisory lock key (any fixed 64-bit number): one creation of procrastinate's schema at a time.
SCHEMA_LOCK_KEY = 0x6D635F736368656D


def is_postgres(url: str | None) -> bool:
    return url is not None and make_url(url).get_backend_name() == "postgresql"


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://u:p@h/db`` (SQLAlchemy's) -> ``postgresql://u:p@h/db`` (libpq's, for procrastinate)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def ensure_queue_schema(engine: Engine) -> None:
    """Create procrastinate's own tables if missing (one process at a time: a service and its workers starting
    together each try). They are procrastinate's schema, of its version, not the store's: the store's tables,
    ``workers`` included, are the migrations' (``multicomposite db upgrade``)."""
    from procrastinate.schema import SchemaManager

    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
        if conn.execute(text("SELECT to_regclass('procrastinate_jobs')")).scalar() is None:
            # Without parameters psycopg sends the script as is (several statements, % signs untouched).
            with conn.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(SchemaManager.get_schema())


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


async def defer_async(app: procrastinate.App, job_id: str, kind: str) -> int:
    """``defer`` from a worker's event loop."""
    return await app.configure_task(name=TASK_NAME, queue=queue_for(kind)).defer_async(job_id=job_id)
