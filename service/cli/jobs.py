"""``multicomposite jobs``: the verify and profile jobs the service has run or queued, read from the store. In
``--json`` a job is the store's record with its stacks spelled vmap(grad) and its times in ISO 8601 (UTC), as
GET /jobs/{id} gives them."""

from __future__ import annotations

import argparse
import time
from typing import Any

from registry.store.job_states import JOB_STATES
from service import cli_output as out
from service.cli import arguments
from service.cli.store import open_store
from service.cli_output import UsageError


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + "Z"


def job_json(job: Any) -> dict[str, Any]:
    from service.models import public_params
    from service.timestamps import iso_utc

    row = {**vars(job), "params": public_params(job.params)}
    for name in ("created_at", "started_at", "finished_at", "updated_at"):
        row[name] = iso_utc(row[name])
    return row


def run(args: argparse.Namespace) -> int:
    from registry.core.stacks import shorten
    from registry.store.job_store import JobStore

    store = open_store(JobStore)
    try:
        if args.id is not None:
            job = store.job(args.id)
            if job is None:
                raise UsageError(f"no job {shorten(args.id)!r} in the store at {store.url}; `multicomposite jobs` "
                                 "lists them")
            jobs = [job]
        else:
            jobs = store.jobs(states=args.state)
    finally:
        store.close()
    if args.json:
        listed = [job_json(job) for job in jobs]
        out.print_json(listed[0] if args.id is not None else listed)
        return 0
    out.print_table(("id", "kind", "state", "progress", "created", "finished", "error"),
                    [(job.id, job.kind, job.state, f"{job.done}/{job.total}", _when(job.created_at),
                      _when(job.finished_at), job.error) for job in jobs])
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", nargs="?", default=None, help="one job's id (default: list every job)")
    parser.add_argument("--state", action="append", choices=JOB_STATES,
                        help=f"only jobs in this state: {', '.join(JOB_STATES)} (repeatable)")
    arguments.add_json(parser, "the jobs (or the one job) with their parameters and results")
    parser.set_defaults(run=run)
