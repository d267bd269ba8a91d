"""Profiles: stored and read back, ranked by auto, never overruling validity; a killed run leaves the store whole."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import registry
from registry.core import kernels
from registry.core.sources import source_hashes
from registry.profiling.timing import bucket, profile
from registry.store import evidence
from registry.store.db import Store
from registry.store.records import ProfileEntry

# Timings (thread CPU time, its share of wall time): alone, after make test's parallel part.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]


def _profile(composite: str, kind: str, median: float, *, op: str = "index_add", stack=("vmap",), valid=True,
             batch: int = 32) -> ProfileEntry:
    return ProfileEntry(op=op, composite=composite, kind=kind, stack=stack, workload="vmap", dtype="float32",
                        device="cpu", device_name="cpu", numel_bucket=1024, batch_size=batch, valid=valid,
                        detail="" if valid else "differs", median_us=median if valid else None,
                        iqr_us=1.0 if valid else None, runs=100 if valid else 0, peak_memory=None,
                        source_hash=source_hashes()[op, composite], torch_version=torch.__version__)


@pytest.fixture(autouse=True)
def _restore_evidence():
    yield
    evidence.use_profile_loader(None)
    evidence.use_loader(None)


def test_bucket() -> None:
    assert [bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


def test_profiles_round_trip_through_sqlite(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'p.db'}")
    written = [_profile("native", "native", 10.0), _profile("functional", "functional", 20.0, batch=256),
               _profile("mutating", "mutating", 0.0, valid=False)]
    assert store.write_profiles(written) == 3
    assert sorted(store.profiles(op="index_add"), key=lambda p: p.composite) == sorted(written,
                                                                                      key=lambda p: p.composite)
    assert store.fresh_profiles(source_hashes=source_hashes(), torch_version="0.0") == []
    store.write_profiles([replace(written[0], median_us=12.0)])  # upsert by key
    assert [p.median_us for p in store.profiles(op="index_add") if p.composite == "native"] == [12.0]
    store.close()


def _choice(numel: int = 1000) -> registry.Decision:
    return registry.select("index_add", stack="vmap", batched=["self", "source"], dtype="float32", numel=numel)


def test_choice_follows_timings_and_flips_when_they_flip() -> None:
    evidence.set_profiles([_profile("native", "native", 10.0), _profile("functional", "functional", 20.0),
                           _profile("primitive", "primitive", 40.0)])
    decision = _choice()
    assert decision.composite == "native"
    assert decision.runner_up_speedup == pytest.approx(2.0)
    evidence.set_profiles([_profile("native", "native", 30.0), _profile("functional", "functional", 10.0),
                           _profile("primitive", "primitive", 40.0)])
    decision = _choice()
    assert decision.composite == "functional"
    assert decision.speedup == pytest.approx(3.0)
    # Native is the runner-up: named once, not "3.00x faster than native; 3.00x faster than native".
    assert decision.reason.startswith("functional is the fastest valid composite measured under vmap with self, "
                                      "source batched (3.00x faster than native; profiled at ")


def test_invalid_never_chosen_however_fast() -> None:
    # mutating is invalid under vmap by the rules; functional's profile says it differs from the reference.
    evidence.set_profiles([_profile("native", "native", 30.0), _profile("mutating", "mutating", 0.001),
                           _profile("functional", "functional", 0.0, valid=False),
                           _profile("primitive", "primitive", 40.0)])
    assert _choice().composite == "native"
    evidence.set_profiles([_profile("native", "native", 30.0, op="masked_scatter"),
                           _profile("functional", "functional", 50.0, op="masked_scatter"),
                           _profile("primitive", "primitive", 45.0, op="masked_scatter")])
    decision = registry.select("masked_scatter", stack="vmap", dtype="float32", numel=1000)
    assert decision.composite == "primitive"  # native is faster, but it loops: never chosen
    # Slower than native says so, never "0.67x faster".
    assert "(1.50x slower than native; 1.11x faster than functional; profiled at " in decision.reason
    assert "native is invalid here (slow:" in decision.reason


def test_rules_policy_ignores_profiles_and_fastest_says_when_unprofiled() -> None:
    evidence.set_profiles([_profile("native", "native", 30.0), _profile("functional", "functional", 10.0)])
    assert registry.select("index_add", stack="vmap", dtype="float32", numel=1000, policy="rules").kind == "native"
    assert registry.select("index_add", stack="vmap", dtype="float32", numel=1000,
                           policy="fastest").composite == "functional"
    unprofiled = registry.select("index_copy", stack="vmap", dtype="float32", policy="fastest")
    assert unprofiled.reason.endswith("(no profile here: rules decide).")


def test_profile_times_every_composite_and_flags_invalid() -> None:
    # What is stored, not the noise control (tested below): a 10 ms run on a loaded machine is always disturbed.
    entries = profile(ops=["masked_scatter"], workloads=["vmap"], batch_sizes=(4,), numels=(64,),
                      min_run_time=0.01, spread_limit=math.inf)
    # cpp_op's composite is timed where the C++ ops are built (make test builds them).
    expected = {"native", "mutating", "functional", "primitive"}
    expected |= {"cpp_op"} if kernels.fused_ops_available() else set()
    entries = [e for e in entries if e.composite in expected]
    assert {e.composite for e in entries} == expected
    assert all(e.stack == ("vmap",) and e.numel_bucket == 64 and e.batch_size == 4 for e in entries)
    assert all(e.valid and e.median_us > 0 and e.runs > 0 for e in entries)
    jac = profile(ops=["index_fill"], workloads=["jacfwd"], batch_sizes=(2,), min_run_time=0.01,
                  spread_limit=math.inf)
    by_name = {e.composite: e for e in jac}
    assert by_name["functional"].valid
    assert by_name["mutating"].stack == ("vmap", "vmap", "jvp")


def test_opinfo_profiles_skip_random_samples_and_say_why_a_workload_has_none() -> None:
    # rrelu's first OpInfo samples are training ones, random under vmap: the eval sample is timed instead.
    refused: list[str] = []
    entries = profile(ops=["rrelu", "hash_tensor"], workloads=["vmap", "vmap(grad)"], batch_sizes=(4,),
                      min_run_time=0.01, spread_limit=math.inf, refused=refused)
    by_key = {(e.op, e.workload, e.composite): e for e in entries}
    assert by_key[("rrelu", "vmap", "functional")].valid
    assert by_key[("rrelu", "vmap(grad)", "functional")].valid
    assert by_key[("rrelu", "vmap", "native")].detail == (
        "RuntimeError: vmap: we do not yet support aten::rrelu. Please file an issue")
    assert by_key[("hash_tensor", "vmap", "functional")].valid and by_key[("hash_tensor", "vmap", "native")].valid
    # An integer output has no gradient: said, not stored.
    assert not any(op == "hash_tensor" and workload == "vmap(grad)" for op, workload, _ in by_key)
    assert refused == ["hash_tensor vmap(grad) b=4: not profiled, the survey cannot check it: op does not support "
                       "autograd"]
    refused.clear()
    assert profile(ops=["chalf"], workloads=["vmap(grad)"], batch_sizes=(4,), refused=refused) == []
    assert refused == ["chalf vmap(grad) b=4: not profiled, no real floating output to differentiate (complex or "
                       "integer outputs only)"]
    refused.clear()
    # bincount's kernel refuses float32, the profile's dtype: said under every workload, not a traceback.
    assert profile(ops=["bincount"], workloads=["vmap", "vmap(grad)"], batch_sizes=(4,), refused=refused) == []
    assert refused == ["bincount vmap b=4: not profiled, no reference outside the transform (NotImplementedError: "
                       "\"bincount_cpu\" not implemented for 'Float')",
                       "bincount vmap(grad) b=4: not profiled, the survey cannot check it: op does not support "
                       "autograd"]
    refused.clear()
    assert profile(ops=["one_hot"], workloads=["vmap(grad)"], batch_sizes=(4,), refused=refused) == []
    assert refused == ["one_hot vmap(grad) b=4: not profiled, no reference outside the transform (RuntimeError: "
                       "one_hot is only applicable to index tensor of type LongTensor.)"]


def test_killed_profiling_run_leaves_a_consistent_store(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'killed.db'}"
    script = textwrap.dedent(f"""
        import sys
        from registry.profiling.timing import profile
        from registry.store.db import Store
        store = Store({url!r})
        print("ready", flush=True)
        while True:
            store.write_profiles(profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,),
                                         min_run_time=0.001, spread_limit=float("inf")))
            print("batch", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.stdout.readline().strip() == "batch"
        time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    store = Store(url)
    assert store.integrity_ok()
    rows = store.profiles(op="index_add")
    built = {"cpp_op"} if kernels.fused_ops_available() else set()  # index_add's rows op, where it is built
    assert {p.composite for p in rows} == {"native", "mutating", "functional", "primitive"} | built
    store.close()
