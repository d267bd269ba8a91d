"""A profile measured under contention is re-measured, then refused, never stored as a ranking that differs from the
quiet one (``noise.contended``: the share of its blocks' wall time the timing thread ran)."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest

from registry.core import reference
from registry.profiling import noise
from registry.profiling.timing import profile

# Timings (thread CPU time, its share of wall time): alone, after make test's parallel part.
pytestmark = pytest.mark.serial


def _matmul_loop(seconds: float, running: Any) -> None:
    """What keeps both cores busy: a 2-thread matmul loop. ``running`` is set once it multiplies (a spawned process
    imports torch first, which takes seconds on a loaded machine)."""
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    running.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a @ b


def test_contended_says_why_below_the_share_and_nothing_above() -> None:
    quiet = {"a": noise.Timed("a", [1.0] * 3, ran=[0.97, 0.99, 0.95]), "b": noise.Timed("b", [2.0] * 3, ran=[0.9] * 3)}
    assert noise.contended(quiet) == []
    busy = {"a": noise.Timed("a", [1.0] * 3, ran=[0.4, 0.5, 0.6]), "b": noise.Timed("b", [2.0] * 3, ran=[0.5] * 3)}
    assert noise.contended(busy) == [
        "measured under contention (the timing thread ran 50% of the wall time of its blocks, below 85%: other "
        "processes or threads held the cores); re-run where nothing else keeps the cores busy"]
    assert noise.contended({"a": noise.Timed("a", [1.0])}) == []  # no CPU clock: nothing to tell


def test_a_profile_under_a_two_thread_matmul_load_is_refused_or_ranks_as_the_quiet_one() -> None:
    """masked_scatter under vmap(grad) at batch 256 x 1,000 while another process runs a 2-thread matmul loop: the
    load is seen, and the context is re-measured, then refused; whatever is stored ranks first what the quiet
    reference does (primitive)."""
    quiet = reference.reference_times("masked_scatter", ("vmap", "grad"), "float32")
    assert quiet is not None
    quiet_fastest = min(quiet.times_us, key=quiet.times_us.__getitem__)
    spawn = multiprocessing.get_context("spawn")
    running = spawn.Event()
    load = spawn.Process(target=_matmul_loop, args=(60.0, running), daemon=True)
    load.start()
    refused: list[str] = []
    try:
        assert running.wait(60), "the load process did not start its matmul loop within 60 s"
        time.sleep(0.5)  # both of its threads are up
        entries = profile(ops=["masked_scatter"], workloads=["vmap(grad)"], numels=(1000,), batch_sizes=(256,),
                          min_run_time=0.03, rounds=3, retries=1, earlier=[], refused=refused)
    finally:
        load.terminate()
        load.join(10)
    # Among the composites the quiet reference ranks (cpp_op, newer than the shipped reference, is not one of them).
    timed = {e.composite: e.median_us for e in entries
             if e.valid and e.median_us is not None and e.composite in quiet.times_us}
    if timed:
        assert min(timed, key=timed.__getitem__) == quiet_fastest
    else:
        assert len(refused) == 1
        assert "not stored, still disturbed after 1 re-measurements (" in refused[0]
        assert "measured under contention (the timing thread ran " in refused[0]


@pytest.mark.parametrize("share", [0.5, 0.84])
def test_below_the_limit_is_contended(share: float) -> None:
    timed = {"a": noise.Timed("a", [1.0], ran=[share])}
    assert noise.contended(timed)
