"""``multicomposite worker``: its arguments and what it runs (the worker itself is ``service/jobs/worker.py``)."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from service.cli.arguments import positive_int, positive_seconds  # one wording for every command
from service.cli_output import UsageError
from service.jobs.kinds import check_kind  # imports nothing: `worker --help` loads neither torch nor the store


def _kind_arg(value: str) -> str:
    try:
        return check_kind(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def configure_worker(worker: argparse.ArgumentParser) -> None:
    """``multicomposite worker``: its arguments, on the parser the CLI's table of subcommands made."""
    worker.add_argument("--device-kind", action="append", type=_kind_arg, dest="device_kinds",
                        help="a device kind to take jobs for: cpu or cuda:NAME (repeatable; default: every kind "
                             "this machine has, see `--list-kinds`)")
    worker.add_argument("--concurrency", type=positive_int, default=1,
                        help="jobs run at once, each by its own worker process (default 1; profiles on one machine "
                             "still time one at a time, under the benchmark lock)")
    worker.add_argument("--heartbeat", type=positive_seconds, default=5.0, dest="heartbeat_s",
                        help="seconds between heartbeats (default 5)")
    worker.add_argument("--stale-after", type=positive_seconds, default=30.0, dest="stale_after_s",
                        help="a worker silent this many seconds is taken as dead and its job retried or failed "
                             "(default 30)")
    worker.add_argument("--max-attempts", type=positive_int, default=2,
                        help="runs of a job whose worker died before it is marked failed (default 2)")
    worker.add_argument("--list-kinds", action="store_true", help="print the device kinds of this machine and exit")
    worker.set_defaults(run=run_worker_command)


def run_worker_command(args: argparse.Namespace) -> int:
    from registry.store.connection import StoreUnavailableError
    from service.jobs.kinds import detect_device_kinds, queue_for
    from service.jobs.tasks import is_postgres
    from service.jobs.worker import NEEDS_POSTGRES, Worker, WorkerOptions, WorkerSetupError, log
    from service.settings import SettingsError, load_settings

    present = detect_device_kinds()
    if args.list_kinds:
        for kind in present:
            print(kind)
        return 0
    kinds = tuple(dict.fromkeys(args.device_kinds or present))
    missing = [kind for kind in kinds if kind not in present]
    if missing:
        raise UsageError(f"device kind {missing[0]!r} is not on this machine; it has {', '.join(present)}")
    if args.heartbeat_s >= args.stale_after_s:
        raise UsageError(f"--heartbeat {args.heartbeat_s:g} must be below --stale-after {args.stale_after_s:g}, or "
                         "every worker looks dead between two beats")
    try:
        settings = load_settings()
        url = settings.db
        if not is_postgres(url):
            raise WorkerSetupError(NEEDS_POSTGRES)
        if args.concurrency > 1:
            return _run_processes(args, kinds)
        worker = Worker(WorkerOptions(url=url, kinds=kinds,
                                      heartbeat_s=args.heartbeat_s, stale_after_s=args.stale_after_s,
                                      max_attempts=args.max_attempts, timeout_s=settings.job_timeout_s))
    except (SettingsError, WorkerSetupError, StoreUnavailableError) as error:
        raise UsageError(str(error)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("worker %s: device kinds %s, queues %s", worker.id, ", ".join(kinds),
             ", ".join(queue_for(kind) for kind in kinds))
    worker.run()
    return 0


def _run_processes(args: argparse.Namespace, kinds: tuple[str, ...]) -> int:
    """``--concurrency N``: N worker processes, each with its own row, running one job at a time. Processes rather
    than threads: the verification harness and torch's lazily loaded modules are not safe to run twice at once in one
    interpreter (two verify jobs in two threads failed on a half-imported torch.autograd module)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "service.cli", "worker", "--concurrency", "1", "--heartbeat",
               str(args.heartbeat_s), "--stale-after", str(args.stale_after_s), "--max-attempts",
               str(args.max_attempts)]
    for kind in kinds:
        command += ["--device-kind", kind]
    children = [subprocess.Popen(command) for _ in range(args.concurrency)]

    forwarded: set[int] = set()

    def forward(signum: int, _frame: Any) -> None:
        forwarded.add(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    # A child told to stop before its worker installed its own handlers (it registers its row first) dies of the
    # signal itself: that is the stop that was asked for, not a failure.
    codes = [0 if -child.wait() in forwarded else child.returncode for child in children]
    return max(codes, key=abs)
