"""``JobBackend``: what the API asks of whatever runs its jobs (``local.LocalRunner`` or ``queue.QueuedJobs``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from registry.store.records import JobRecord

Job = JobRecord
# What a job reports as it goes: cases done, cases in all.
Progress = Callable[[int, int], None]
# What a job does: its work, reporting progress; returns the job's result (JSON).
JobWork = Callable[[Job, Progress], dict[str, Any]]
# Finished jobs older than the retention are deleted at most this often (when idle, or at a submit).
PRUNE_EVERY_S = 60.0


class QueueFullError(Exception):
    """The queue is full: try again later."""


class JobBackend(Protocol):
    """Runs the jobs the API accepts; every job is a row of the store's ``jobs`` table, which any process reads."""

    # Where its jobs run, as a refusal names it: "on this host", "on any worker".
    where: str

    def start(self) -> None:
        """Begin taking jobs (the app's lifespan, once)."""

    def shutdown(self) -> None:
        """Stop taking jobs (the app's lifespan, at its end)."""

    def submit(self, kind: str, params: dict[str, Any]) -> Job:
        """Accept a job (``verify`` or ``profile``) with checked ``params``; QueueFullError when the queue is full."""

    def status(self, job_id: str) -> Job | None:
        """The job as it stands now; None if there is none."""

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job: a queued one at once, a running one at its next case boundary (``cancelling`` until then);
        a finished one is returned unchanged; None if there is none."""

    def states(self) -> dict[str, int]:
        """Jobs by state (the metrics)."""

    def device_kinds(self) -> tuple[str, ...]:
        """The device kinds a job may be aimed at (``cpu``, ``cuda:NAME``)."""

    def device_types(self) -> tuple[str, ...]:
        """The torch device types a profile job may run on (``cpu``, ``cuda``)."""
