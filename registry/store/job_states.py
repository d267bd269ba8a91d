"""The states of a job, apart from the store's tables so that the command line's ``--help`` lists them without
importing SQLAlchemy or torch."""

from __future__ import annotations

# cancelling: a running job asked to stop; its runner stops at the next case boundary and marks it cancelled.
JOB_STATES: tuple[str, ...] = ("queued", "running", "cancelling", "done", "failed", "cancelled", "interrupted")
ACTIVE_JOB_STATES: tuple[str, ...] = ("running", "cancelling")  # a runner has it
FINISHED_JOB_STATES: tuple[str, ...] = ("done", "failed", "cancelled", "interrupted")
