"""One benchmarking process per machine: an ``fcntl`` lock on a file in the data dir that every profile run takes
(the CLI, a server's job worker, any other process), and a check afterwards that no other run overlapped.

Two processes timing at once slow each other down by factors (index_copy functional under vmap measured 7,997 us at
batch 64 next to 87 us at batch 32): such timings are stored, but never as valid.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK_NAME = "benchmark.lock"


class BenchmarkBusyError(RuntimeError):
    """Another process holds the benchmark lock, and the caller asked not to wait."""


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@contextmanager
def benchmark_lock(folder: Path, *, wait: bool = True,
                   on_wait: Callable[[str, Path], None] | None = None) -> Iterator[Path]:
    """Hold ``folder/benchmark.lock`` (exclusive, released when the process dies, even by kill -9).

    Held by another process: with ``wait``, call ``on_wait(holder_pid, path)`` once and block until it is free;
    without, raise BenchmarkBusyError naming the holder.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(path)
            if not wait:
                raise BenchmarkBusyError(f"another benchmarking process (pid {holder}) holds {path}; wait for it to "
                                         "finish, timings taken side by side are not valid") from None
            if on_wait is not None:
                on_wait(holder, path)
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, str(os.getpid()).encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(descriptor, 0)
            fcntl.flock(descriptor, fcntl.LOCK_UN)
    finally:
        os.close(descriptor)


def mark_overlapped(profiles: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """``profiles`` with every valid one made invalid when ``others`` (overlapping runs) is not empty."""
    if not others:
        return list(profiles)
    names = ", ".join(f"{run.kind} pid {run.pid}" for run in others[:3])
    detail = f"timed while another benchmarking process ran ({names}); run profile again"
    return [dataclasses.replace(p, valid=False, detail=detail) if p.valid else p for p in profiles]


def timed_run(store: Any, kind: str, work: Callable[[], Sequence[Any]], *, wait: bool = True,
              on_wait: Callable[[str, Path], None] | None = None) -> list[Any]:
    """Run ``work()`` (a profile) under the benchmark lock, recorded as a run in ``store``; what it returns comes
    back marked invalid if another recorded run overlapped it."""
    with benchmark_lock(store.data_dir(), wait=wait, on_wait=on_wait):
        run_id = store.begin_run(kind)
        try:
            profiles = work()
        finally:
            store.end_run(run_id)
        return mark_overlapped(profiles, store.overlapping_runs(run_id))


@contextmanager
def recorded_run(store: Any, kind: str) -> Iterator[int]:
    """Record a run that loads the machine without timing (verify), so that a profile beside it is marked."""
    run_id = store.begin_run(kind)
    try:
        yield run_id
    finally:
        store.end_run(run_id)
