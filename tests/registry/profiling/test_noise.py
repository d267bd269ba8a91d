"""Profiles that noise cannot fool: interleaved rounds, spread, re-measurement and refusal of disturbed contexts,
decisions that stay put within the noise, and reasons that never say "0.62x faster"."""

from __future__ import annotations

import math
import multiprocessing
import threading
from dataclasses import replace

import pytest
import torch

import registry
from registry.core import kernels
from registry.core.sources import source_hashes
from registry.profiling import noise
from registry.profiling.timing import profile
from registry.store import evidence
from registry.store.records import ProfileEntry

# Timings (thread CPU time, its share of wall time): alone, after make test's parallel part.
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def _restore_evidence():
    yield
    evidence.use_profile_loader(None)
    evidence.use_loader(None)


class VirtualClock:
    """A clock in which every reading is one second after the previous one, plus a burst of ``burst`` seconds at
    every fourth reading while ``disturbed()`` says so: timings that are exactly equal, or exactly disturbed."""

    def __init__(self, disturbed=lambda reading: False, burst: float = 10.0) -> None:
        self.now, self.readings, self.disturbed, self.burst = 0.0, 0, disturbed, burst

    def __call__(self) -> float:
        self.readings += 1
        self.now += 1.0 + (self.burst if self.readings % 4 == 0 and self.disturbed(self.readings) else 0.0)
        return self.now


def test_ratio_text_never_says_faster_for_slower() -> None:
    assert noise.ratio_text(1 / 1.6, "native") == "1.60x faster than native"
    assert noise.ratio_text(1.6, "native") == "1.60x slower than native"
    assert noise.ratio_text(1.0, "functional") == "1.00x faster than functional"


def test_timed_spread_is_iqr_over_median() -> None:
    quiet = noise.Timed("native", [100.0, 101.0, 99.0, 100.0, 100.0])
    assert quiet.median_us == 100.0 and quiet.iqr_us == pytest.approx(0.0) and quiet.spread == pytest.approx(0.0)
    burst = noise.Timed("functional", [100.0, 100.0, 160.0, 170.0, 100.0])
    assert burst.iqr_us == pytest.approx(60.0) and burst.spread == pytest.approx(0.6)
    assert noise.disturbed({"native": quiet, "functional": burst}) == [
        "functional spread 60% (IQR/median) above 20%"]
    assert noise.disturbed({"native": quiet}, native="native", earlier_native_us=40.0) == [
        "native 100 us is 2.50x slower than its earlier profile (40 us)"]
    assert noise.disturbed({"native": quiet}, native="native", earlier_native_us=120.0) == []


def test_interleaved_rotates_the_order_every_round() -> None:
    calls: list[str] = []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("native", "a", "b")}
    timed = noise.interleaved(runners, rounds=3, clock=VirtualClock())
    # Two warm/calibration calls each, then one call per block (the virtual second is longer than any block).
    assert calls[6:] == ["native", "a", "b", "a", "b", "native", "b", "native", "a"]
    assert {name: t.rounds_us for name, t in timed.items()} == {name: [1e6] * 3 for name in runners}


def _decisions(entries: list[ProfileEntry]) -> dict[tuple, str]:
    evidence.set_profiles(entries)
    decisions = {}
    for e in entries:
        batched = registry.OPS[e.op].tensor_args if "vmap" in e.stack else ()
        decision = registry.select(e.op, stack=e.stack, batched=batched, dtype=e.dtype, numel=e.numel_bucket)
        decisions[e.op, e.stack] = decision.composite
    return decisions


def test_a_burst_on_single_rounds_moves_no_ranking() -> None:
    # Bursts land on one composite's round at a time: the per-round ratios keep the tie, nothing is re-measured.
    clock = VirtualClock(disturbed=lambda reading: reading < 40)
    entries = profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,), clock=clock)
    timed = [e for e in entries if e.valid]
    built = {"cpp_op"} if kernels.fused_ops_available() else set()  # index_add's rows op, where it is built
    assert {e.composite for e in timed} == {"native", "mutating", "functional", "primitive"} | built
    assert not any("re-measured" in e.detail for e in timed), timed[0].detail
    assert len({e.median_us for e in timed}) == 1


def _flipping() -> dict[str, noise.Timed]:
    # a is faster by the median ratio (1.2x) but only in 3 of 5 rounds
    return {"a": noise.Timed("a", [100.0, 100.0, 100.0, 300.0, 300.0]),
            "b": noise.Timed("b", [120.0, 120.0, 120.0, 100.0, 100.0])}


def test_a_ranking_is_unstable_only_when_the_leader_loses_rounds() -> None:
    assert noise.unstable(_flipping()) == [
        "the ranking of a and b is unstable (a 1.20x faster by the median ratio, yet faster in only 3 of 5 rounds): "
        "re-run with a longer --min-run-time (more calls per round), or where fewer processes compete for the "
        "cores"]
    # Under a load that doubles every time of some rounds, a is faster in every round: settled.
    loaded = {"a": noise.Timed("a", [100.0, 200.0, 100.0, 400.0, 100.0]),
              "b": noise.Timed("b", [150.0, 300.0, 150.0, 600.0, 150.0])}
    assert noise.unstable(loaded) == []
    assert loaded["b"].spread > noise.SPREAD_LIMIT  # the absolute times spread far beyond the old limit
    relative = noise.relative(loaded)
    assert relative["a"].median_us == 100.0 and relative["b"].median_us == pytest.approx(150.0)
    assert relative["b"].spread == pytest.approx(0.0)
    # Not told apart (within MIN_NOISE by the median ratio): a settled tie, whichever wins each round.
    tie = {"a": noise.Timed("a", [100.0, 104.0, 100.0, 104.0, 100.0]),
           "b": noise.Timed("b", [103.0, 100.0, 103.0, 100.0, 103.0])}
    assert noise.unstable(tie) == []


def test_a_context_whose_ranking_stays_unstable_is_not_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.profiling import timing

    def flipping(runners, *, rounds, min_run_time, clock, cpu_clock=None, timed=None, wall_clock=None):
        # the first composite as a in _flipping, the others as b, each slower than the one before
        leader, others = [100.0, 100.0, 100.0, 300.0, 300.0], [120.0, 120.0, 120.0, 100.0, 100.0]
        return {name: noise.Timed(name, leader if i == 0 else [x * (1 + 0.5 * (i - 1)) for x in others])
                for i, name in enumerate(timed or runners)}

    monkeypatch.setattr(timing.noise, "interleaved", flipping)
    refused: list[str] = []
    entries = profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,), retries=1,
                      refused=refused)
    assert entries == []  # no timing, and no composite of index_add is invalid here
    assert len(refused) == 1
    assert refused[0].startswith("index_add vmap n=16 b=2 float32: not stored, still disturbed after 1 "
                                 "re-measurements (the ranking of native and mutating is unstable (")
    assert refused[0].endswith("re-run with a longer --min-run-time (more calls per round), or where fewer "
                               "processes compete for the cores)")


def test_native_faster_than_its_earlier_profile_is_re_measured_once_then_kept() -> None:
    # The earlier profile was the disturbed one (3x slower than now): re-measured once, then stored.
    earlier = profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,), clock=VirtualClock())
    native = next(e for e in earlier if e.kind == "native")
    slow_earlier = [replace(native, median_us=native.median_us * 3)]
    entries = profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,), clock=VirtualClock(),
                      earlier=slow_earlier)
    again = next(e for e in entries if e.kind == "native")
    assert again.detail.startswith("re-measured 1x: native 1000000 us is 3.00x faster than its earlier profile "
                                   "(3000000 us)")


def test_native_far_from_its_earlier_profile_is_re_measured_then_kept_when_quiet() -> None:
    earlier = profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,), clock=VirtualClock())
    native = next(e for e in earlier if e.kind == "native")
    slow_earlier = [replace(native, median_us=native.median_us / 3)]
    entries = profile(ops=["index_add"], workloads=["vmap"], batch_sizes=(2,), numels=(16,), clock=VirtualClock(),
                      earlier=slow_earlier)
    again = next(e for e in entries if e.kind == "native")
    assert again.detail.startswith("re-measured 1x: native 1000000 us is 3.00x slower than its earlier profile "
                                   "(333333 us)")


def test_a_load_that_falls_unevenly_is_named() -> None:
    # Two busy processes take the same share from every composite: the ratios hold. A busy thread holding the GIL
    # takes more from the composite of more calls: named, with what to change.
    even = {"a": noise.Timed("a", [100.0] * 5, ran=[0.25, 0.24, 0.26, 0.25, 0.25]),
            "b": noise.Timed("b", [150.0] * 5, ran=[0.22, 0.26, 0.24, 0.23, 0.25])}
    assert noise.uneven(even) == []
    skewed = {"a": noise.Timed("a", [100.0] * 5, ran=[0.3, 0.31, 0.29, 0.3, 0.3]),
              "b": noise.Timed("b", [150.0] * 5, ran=[0.9, 0.93, 0.94, 0.92, 0.91])}
    assert noise.uneven(skewed) == [
        "the load fell unevenly on the composites (a ran 30% of the time it was timed, b 92%): another busy thread "
        "of this process holds the GIL; re-run with no other busy thread in the profiling process"]
    assert noise.uneven({"a": noise.Timed("a", [1.0]), "b": noise.Timed("b", [2.0])}) == []  # no CPU clock given


def test_interleaved_records_the_share_each_block_ran() -> None:
    # A CPU clock that advances half as fast as the wall clock: every block ran half of its time.
    wall, cpu = VirtualClock(), VirtualClock()
    timed = noise.interleaved({"a": lambda: None, "b": lambda: None}, rounds=3, clock=wall,
                              cpu_clock=lambda: cpu() / 2)
    assert all(t.ran == [pytest.approx(0.5)] * 3 for t in timed.values())


def _entry(composite: str, kind: str, median: float, iqr: float, *, op: str = "index_add") -> ProfileEntry:
    return ProfileEntry(op=op, composite=composite, kind=kind, stack=("vmap",), workload="vmap", dtype="float32",
                        device="cpu", device_name="cpu", numel_bucket=1024, batch_size=32, valid=True, detail="",
                        median_us=median, iqr_us=iqr, runs=100, peak_memory=None,
                        source_hash=source_hashes()[op, composite], torch_version=torch.__version__)


def test_within_the_noise_the_rules_choice_stays() -> None:
    # Rules prefer native for index_add under vmap; functional is 4% faster with a 10% spread: no flip.
    evidence.set_profiles([_entry("native", "native", 100.0, 10.0), _entry("functional", "functional", 96.0, 9.6),
                           _entry("primitive", "primitive", 300.0, 3.0)])
    decision = registry.select("index_add", stack="vmap", batched=["self", "source"], dtype="float32", numel=1000)
    assert decision.composite == "native"
    assert decision.reason.startswith(
        "native is the rules' choice under vmap with self, source batched, and the profiles do not tell it from "
        "the fastest, functional, beyond the noise (1.04x slower than functional, spread 10%")
    # Beyond the noise it does flip.
    evidence.set_profiles([_entry("native", "native", 100.0, 10.0), _entry("functional", "functional", 50.0, 5.0)])
    decision = registry.select("index_add", stack="vmap", batched=["self", "source"], dtype="float32", numel=1000)
    assert decision.composite == "functional"
    assert "(2.00x faster than native; profiled at" in decision.reason


def test_reason_says_slower_when_the_choice_is_slower_than_native() -> None:
    # native loops under vmap (invalid by the rules) but is faster here; the choice says "slower", not "0.67x faster".
    evidence.set_profiles([_entry("native", "native", 30.0, 1.0, op="masked_scatter"),
                           _entry("functional", "functional", 50.0, 1.0, op="masked_scatter"),
                           _entry("primitive", "primitive", 45.0, 1.0, op="masked_scatter")])
    decision = registry.select("masked_scatter", stack="vmap", dtype="float32", numel=1000)
    assert decision.composite == "primitive"
    assert "(1.50x slower than native; 1.11x faster than functional;" in decision.reason
    assert "0." not in decision.reason.split("(")[1].split(";")[0]


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _spin_process(seconds: float) -> None:
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


CONTEXTS = dict(ops=["masked_fill", "index_fill"], workloads=["vmap"], batch_sizes=(64,), numels=(256,),
                min_run_time=0.1)


def test_a_profile_under_load_gives_the_quiet_profiles_choices() -> None:
    """Two busy processes (one per core) and a busy thread (holding the GIL half the time) while profiling: the
    absolute times swing, and the per-round ratios hold where the load falls on every composite alike. Every
    decision is the quiet profile's: a context is stored only where its ranking held, and refused, saying what to
    change, where it flipped between rounds or the busy thread took more from some composites than from others."""
    quiet_refused: list[str] = []
    quiet = profile(**CONTEXTS, retries=4, refused=quiet_refused)
    quiet_decisions = _decisions(quiet)
    if not quiet_decisions and all("measured under contention" in line for line in quiet_refused):
        pytest.skip(f"no quiet baseline: the contention detector refused it ({quiet_refused[0]})")
    assert quiet_decisions, f"the quiet profile itself was refused: {quiet_refused}"
    stop = threading.Event()
    threads = [threading.Thread(target=_spin, args=(stop,), daemon=True)]
    processes = [multiprocessing.get_context("spawn").Process(target=_spin_process, args=(60.0,), daemon=True)
                 for _ in range(2)]
    for t in threads:
        t.start()
    for process in processes:
        process.start()
    refused: list[str] = []
    try:
        loaded = profile(**CONTEXTS, earlier=quiet, refused=refused)
    finally:
        stop.set()
        for process in processes:
            process.terminate()
            process.join(10)
        for t in threads:
            t.join(10)
    # A context is measured to the quiet choice, or refused saying why and what to change; never a flipped decision
    # (the quiet profile stays where one is refused).
    assert all(("is unstable" in line and "longer --min-run-time" in line)
               or ("the load fell unevenly" in line and "no other busy thread" in line)
               or ("measured under contention" in line and "nothing else keeps the cores busy" in line)
               for line in refused), refused
    stored = {(e.op, e.workload, e.batch_size, e.composite): e for e in quiet}
    stored.update({(e.op, e.workload, e.batch_size, e.composite): e for e in loaded})
    decisions = _decisions(list(stored.values()))
    assert {key: decisions[key] for key in quiet_decisions} == quiet_decisions
    assert not math.isnan(sum(e.median_us for e in loaded if e.valid))
