"""Jobs in forked worker processes: a job that raises, crashes its worker or hangs becomes rows that say so, and
the run goes on (the survey's and the conformance suite's).

Why not the standard library's pools: this pool kills the one worker whose job outlived its time and replaces it,
and turns a worker's death into rows for the job it held, while every other job runs on. ``ProcessPoolExecutor``
(fork context, ``max_tasks_per_child``) cannot kill the worker behind one future (``result(timeout=)`` only stops
waiting; the hung worker keeps its slot) and a worker that dies marks the whole pool broken, failing every pending
job. ``multiprocessing.Pool`` replaces a dead worker but never reports the job it held (its result waits forever)
and has no way to kill the worker running a given task. A kept library that does both is ``pebble``'s
``ProcessPool`` (``submit(fn, timeout, ...)`` kills a worker past its time; a crash is that future's
``ProcessExpired``).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from registry.core.messages import described


@dataclass
class _Worker:
    process: Any
    connection: Any
    job: tuple[int, str] | None = None
    started: float = 0.0


def _worker_main(connection: Any, entries: Sequence[Any], config: Any, work: Callable[..., list[Any]],
                 crash: Callable[..., list[Any]]) -> None:
    torch.set_num_threads(1)
    while True:
        job = connection.recv()
        if job is None:
            return
        index, dtype_name = job
        try:
            rows = work(entries[index], dtype_name, config)
        except Exception as error:  # sent back as error rows
            rows = crash(entries[index], dtype_name, config,
                         f"survey worker: {described(error)} ({traceback.format_exc(limit=1).strip()[-200:]})")
        connection.send(rows)


def run_forked(entries: Sequence[Any], jobs: list[tuple[int, str]], config: Any, workers: int,
               job_timeout_s: float, finished: Callable[[list[Any]], None], *, work: Callable[..., list[Any]],
               crash: Callable[..., list[Any]]) -> None:
    """Run ``work(entry, dtype, config)`` for each (entry index, dtype) job in ``workers`` forked processes; a job
    that raises, crashes its worker or outlives ``job_timeout_s`` becomes ``crash(entry, dtype, config, why)``."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")
    pending = list(reversed(jobs))
    pool: list[_Worker] = []

    def spawn() -> _Worker:
        parent, child = context.Pipe()
        process = context.Process(target=_worker_main, args=(child, entries, config, work, crash), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    def assign(worker: _Worker) -> None:
        if pending:
            worker.job = pending.pop()
            worker.started = time.monotonic()
            worker.connection.send(worker.job)
        else:
            worker.job = None

    threads = torch.get_num_threads()
    # While forking (replacements too): a worker inherits one thread, not an OpenMP pool that does not survive fork.
    torch.set_num_threads(1)
    pool = [spawn() for _ in range(min(workers, len(jobs)))]
    for worker in pool:
        assign(worker)
    try:
        while any(w.job is not None for w in pool):
            busy = [w for w in pool if w.job is not None]
            ready = wait([w.connection for w in busy], timeout=5.0)
            now = time.monotonic()
            for worker in busy:
                job = worker.job
                assert job is not None
                if worker.connection in ready:
                    try:
                        rows = worker.connection.recv()
                    except (EOFError, OSError):
                        worker.process.join(1)
                        rows = crash(entries[job[0]], job[1], config,
                                     f"survey worker died (exit code {worker.process.exitcode})")
                        pool[pool.index(worker)] = worker = spawn()
                    finished(rows)
                    assign(worker)
                elif now - worker.started > job_timeout_s:
                    worker.process.kill()
                    worker.process.join(1)
                    finished(crash(entries[job[0]], job[1], config,
                                   f"survey worker killed: the job took over {job_timeout_s:g} s"))
                    pool[pool.index(worker)] = worker = spawn()
                    assign(worker)
    finally:
        for worker in pool:
            with contextlib.suppress(OSError, BrokenPipeError):
                worker.connection.send(None)
            worker.process.join(2)
            if worker.process.is_alive():
                worker.process.kill()
        torch.set_num_threads(threads)

