"""Defect 6: profiles timed by two processes at once were stored as valid (index_copy functional under vmap: 7,997
us at batch 64 next to 87 us at batch 32) and drove ``auto``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from registry.store.benchlock import LOCK_NAME, BenchmarkBusyError, benchmark_lock, timed_run
from registry.store.db import Store
from registry.store.records import ProfileEntry

ROOT = Path(__file__).resolve().parents[3]


def _timing(median: float) -> ProfileEntry:
    return ProfileEntry(op="index_copy", composite="functional", kind="functional", stack=("vmap",),
                        workload="vmap", dtype="float32", device="cpu", device_name="cpu", numel_bucket=1024,
                        batch_size=64, valid=True, detail="", median_us=median, iqr_us=1.0, runs=10,
                        peak_memory=None, source_hash="h", torch_version="t")


def _other_process(script: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


HOLD_LOCK = """
    import sys, time
    from pathlib import Path
    from registry.store.benchlock import benchmark_lock
    with benchmark_lock(Path(sys.argv[1])):
        print("ready", flush=True)
        time.sleep(float(sys.argv[2]))
"""

RUN_ELSEWHERE = """
    import sys, time
    from registry.store.db import Store
    store = Store(sys.argv[1])
    run = store.begin_run("profile")  # a benchmark that does not take the lock (an older version, say)
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
    store.end_run(run)
"""


def test_the_lock_is_exclusive_across_processes(tmp_path: Path) -> None:
    holder = _other_process(HOLD_LOCK, str(tmp_path), "30")
    try:
        with pytest.raises(BenchmarkBusyError, match=f"^another benchmarking process \\(pid {holder.pid}\\) holds "
                                                     f"{tmp_path / LOCK_NAME}; wait for it"), \
                benchmark_lock(tmp_path, wait=False):
            pass
    finally:
        holder.kill()
        holder.wait()
    with benchmark_lock(tmp_path, wait=False) as path:  # released when the holder died, even by kill
        assert path.read_text() == str(__import__("os").getpid())


def test_a_waiting_run_says_whom_it_waits_for(tmp_path: Path) -> None:
    holder = _other_process(HOLD_LOCK, str(tmp_path), "1")
    waited: list[str] = []
    start = time.monotonic()
    with benchmark_lock(tmp_path, on_wait=lambda pid, path: waited.append(pid)):
        assert time.monotonic() - start > 0.3
    holder.wait()
    assert waited == [str(holder.pid)]


def test_a_run_overlapped_by_another_is_stored_invalid(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = Store(url)
    alone = timed_run(store, "profile", lambda: [_timing(87.0)])
    assert [p.valid for p in alone] == [True]
    other = _other_process(RUN_ELSEWHERE, url, "2")
    try:
        overlapped = timed_run(store, "profile", lambda: [_timing(7997.0)])
    finally:
        other.wait()
    assert [(p.valid, p.median_us) for p in overlapped] == [(False, 7997.0)]
    assert overlapped[0].detail == (f"timed while another benchmarking process ran (profile pid {other.pid}); run "
                                    "profile again")
    store.write_profiles(overlapped)
    assert [p.valid for p in store.profiles()] == [False]  # and `auto` ranks by valid timings only
    later = timed_run(store, "profile", lambda: [_timing(88.0)])  # the other run is over: valid again
    assert [p.valid for p in later] == [True]
    store.close()
