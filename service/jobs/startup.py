"""``job_backend(settings, state)``: which ``JobBackend`` the app runs its jobs with, picked once when it starts.

``MULTICOMPOSITE_JOBS``: ``workers`` (procrastinate's queues, run by ``multicomposite worker`` processes),
``in-process`` (this process's own thread), or ``auto`` (the default): workers with a PostgreSQL store, in process
with SQLite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.jobs.local import LocalRunner
from service.jobs.queue import QueuedJobs
from service.jobs.work import make_job_work

if TYPE_CHECKING:
    from service.jobs.backend import JobBackend
    from service.settings import Settings
    from service.state import StoreState


def job_backend(settings: Settings, state: StoreState) -> JobBackend:
    """The backend for the app's open store (``state.require()``); ``state.poll`` runs when a job has written
    results, so that no response cached before the write is served after the job is seen done."""
    store = state.require()
    postgres = store.engine.dialect.name == "postgresql"
    if settings.jobs == "workers" or (settings.jobs == "auto" and postgres):
        return QueuedJobs(store, settings.queue_size, settings.job_retention_s, on_finished=state.poll)
    return LocalRunner(make_job_work(store, on_written=state.poll), store, settings.queue_size,
                       settings.job_timeout_s, settings.job_retention_s)
