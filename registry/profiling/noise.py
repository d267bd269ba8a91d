"""Timings that noise cannot fool: composites timed in interleaved rounds in one process, with their spread, and the
tests that say a context was disturbed and must be re-measured (or not stored at all).

On a shared machine noise only ever adds time, and it comes in bursts (another process's compile, a server's
request): timing native for a second, then each composite for a second, lets a burst land on one of them and flip a
decision. Interleaved rounds (native, a, b, native, a, b, ... with the order rotated each round) spread a burst over
every composite, and the spread across rounds (IQR over median) says whether one came at all.

On a machine kept busy by another process, absolute times swing from round to round, but within one round every
composite runs under the same load: the ratio of two composites' times in the same round holds where their medians
do not. So composites are ranked by their per-round ratios to the fastest one (``relative``), and a context is
refused only when that ranking itself is unstable (``unstable``): the two fastest are told apart by their median
ratio, yet the leader is not faster in most of the rounds they share; or when the load did not fall on every
composite alike (``uneven``: the share of each block's wall time the profiling thread ran, from its CPU time,
differs between composites, as it does when another thread of the process holds the GIL), so that the ratios
themselves moved.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from registry.core.ratios import MIN_NOISE, ratio_text

# A context whose rounds spread more than this (IQR over median, any composite) was disturbed: it is re-measured.
SPREAD_LIMIT = 0.20
# Native's median this many times above or below its earlier profile on the same key: re-measured too.
NATIVE_DRIFT_LIMIT = 1.5
ROUNDS = 5
# The leader of a ranking must be faster than the runner-up in at least this share of the rounds they share.
WIN_SHARE = 0.75
# The composites of a context ran shares of their timed blocks this far apart (largest over smallest median share):
# the load did not fall on them alike. Measured on 2-core x86_64, torch 2.13.0 CPU (masked_fill, index_fill under
# vmap, b=64): quiet 1.03-1.11, two busy processes on both cores 1.04-1.25, a busy Python thread in the profiling
# process 2.3-4.4.
UNEVEN_LIMIT = 1.5
# The timing thread ran less than this share of the wall time of its blocks (median over every block of every
# composite): other processes or threads held the cores, and a ranking measured so may not be the quiet one (a
# memory-bound composite loses more to a neighbour than a compute-bound one). Measured on 2-core x86_64, torch 2.13.0
# CPU (masked_scatter under vmap(grad), b=256, one torch thread, blocks timed in wall time): 0.90-0.96 with the
# machine otherwise idle; 0.14-0.38 with a 2-thread matmul loop or other busy processes on the cores.
CONTENDED_SHARE = 0.85


@dataclass
class Timed:
    """One composite's per-call times over interleaved rounds, in microseconds."""

    name: str
    rounds_us: list[float] = field(default_factory=list)
    calls: int = 0
    first_call_us: float = 0.0  # the first call, which includes any compilation (fused kernels, Inductor)
    # Per round, the share of the block's wall time the calling thread ran (its CPU time over the wall time): what
    # other processes and other threads holding the GIL took from it. Empty when no CPU clock was given.
    ran: list[float] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return statistics.median(self.rounds_us)

    @property
    def iqr_us(self) -> float:
        if len(self.rounds_us) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.rounds_us, n=4, method="inclusive")
        return q3 - q1

    @property
    def spread(self) -> float:
        """IQR over median: 0.05 is a quiet machine, above SPREAD_LIMIT a disturbed one."""
        return self.iqr_us / self.median_us if self.median_us > 0 else 0.0


def _per_call(run: Callable[[], Any], number: int, clock: Callable[[], float],
              cpu_clock: Callable[[], float] | None = None,
              wall_clock: Callable[[], float] | None = None) -> tuple[float, float | None]:
    """(microseconds per call, the share of the wall time the thread ran, or None without a second clock).

    ``clock`` is wall time with ``cpu_clock`` (the thread's CPU time) beside it, or the thread's CPU time itself with
    ``wall_clock`` beside it."""
    cpu = cpu_clock() if cpu_clock is not None else 0.0
    wall_start = wall_clock() if wall_clock is not None else 0.0
    start = clock()
    for _ in range(number):
        run()
    elapsed = clock() - start
    if cpu_clock is not None:
        ran = None if elapsed <= 0 else (cpu_clock() - cpu) / elapsed
    elif wall_clock is not None:
        wall = wall_clock() - wall_start
        ran = None if wall <= 0 else elapsed / wall
    else:
        ran = None
    return elapsed / number * 1e6, ran


def interleaved(runners: Mapping[str, Callable[[], Any]], *, rounds: int = ROUNDS, min_run_time: float = 0.1,
                clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] | None = None,
                timed: Mapping[str, Timed] | None = None,
                wall_clock: Callable[[], float] | None = None) -> dict[str, Timed]:
    """Each runner's per-call time in ``rounds`` interleaved rounds (the order rotated every round), each round a
    block of calls lasting about ``min_run_time / rounds`` seconds. ``timed`` (earlier rounds) is extended. With
    ``cpu_clock`` (the calling thread's CPU time, in the unit of ``clock``) each round also records the share of its
    wall time the thread ran (``Timed.ran``); so does ``wall_clock`` beside a ``clock`` that is the thread's CPU
    time."""
    names = list(runners)
    results = {name: Timed(name) for name in names} if timed is None else dict(timed)
    block = max(min_run_time / max(rounds, 1), 1e-4)
    numbers: dict[str, int] = {}
    for name in names:
        start = clock()
        runners[name]()  # warm: allocations, caches, compilation
        first = clock() - start
        if timed is None:
            results[name].first_call_us = first * 1e6
        single = _per_call(runners[name], 1, clock)[0] / 1e6
        numbers[name] = max(1, int(block / max(single, 1e-7)))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per_call_us, ran = _per_call(runners[name], numbers[name], clock, cpu_clock, wall_clock)
            results[name].rounds_us.append(per_call_us)
            if ran is not None:
                results[name].ran.append(ran)
            results[name].calls += numbers[name]
    return results


def disturbed(timings: Mapping[str, Timed], *, native: str | None = None, earlier_native_us: float | None = None,
              spread_limit: float = SPREAD_LIMIT) -> list[str]:
    """Why these timings cannot be trusted: an empty list when they can."""
    reasons = []
    for t in timings.values():
        if t.spread > spread_limit:
            reasons.append(f"{t.name} spread {t.spread:.0%} (IQR/median) above {spread_limit:.0%}")
    if native is not None and earlier_native_us and native in timings:
        ratio = timings[native].median_us / earlier_native_us
        if ratio > NATIVE_DRIFT_LIMIT or ratio < 1 / NATIVE_DRIFT_LIMIT:
            reasons.append(f"native {timings[native].median_us:.0f} us is {ratio_text(ratio, 'its earlier profile')} "
                           f"({earlier_native_us:.0f} us)")
    return reasons


def _shared_ratios(t: Timed, leader: Timed) -> list[float]:
    shared = min(len(t.rounds_us), len(leader.rounds_us))
    return [t.rounds_us[k] / leader.rounds_us[k] for k in range(shared) if leader.rounds_us[k] > 0]


def leader_of(timings: Mapping[str, Timed]) -> Timed:
    """The composite the others are measured against: the lowest median time."""
    return min(timings.values(), key=lambda t: t.median_us)


def relative(timings: Mapping[str, Timed]) -> dict[str, Timed]:
    """Each composite's rounds as the leader's median times its ratio to the leader in that round: the medians keep
    the scale of one machine's times, and their order and spread are those of the per-round ratios, which a load
    shared by every composite of a round does not move."""
    if len(timings) < 2:
        return dict(timings)
    leader = leader_of(timings)
    scale = leader.median_us
    return {name: Timed(name, [scale * r for r in _shared_ratios(t, leader)] or list(t.rounds_us), t.calls,
                        t.first_call_us, list(t.ran))
            for name, t in timings.items()}


def unstable(timings: Mapping[str, Timed]) -> list[str]:
    """Why the ranking of the two fastest is not settled (empty when it is): their median per-round ratio says one
    is faster by more than MIN_NOISE, yet it is faster in fewer than WIN_SHARE of the rounds they share. Two that
    are not told apart are a settled tie: the selector keeps the rules' choice between them."""
    if len(timings) < 2:
        return []
    leader = leader_of(timings)
    runner = min((t for t in timings.values() if t is not leader), key=lambda t: statistics.median(
        _shared_ratios(t, leader) or [math.inf]))
    ratios = _shared_ratios(runner, leader)
    if not ratios:
        return []
    median = statistics.median(ratios)
    if median <= 1 + MIN_NOISE:
        return []
    wins = sum(r > 1 for r in ratios)
    if wins >= WIN_SHARE * len(ratios):
        return []
    return [f"the ranking of {leader.name} and {runner.name} is unstable ({leader.name} {median:.2f}x faster by the "
            f"median ratio, yet faster in only {wins} of {len(ratios)} rounds): re-run with a longer --min-run-time "
            "(more calls per round), or where fewer processes compete for the cores"]


def uneven(timings: Mapping[str, Timed]) -> list[str]:
    """Why the per-round ratios cannot be trusted (empty when they can): the composites ran shares of their timed
    blocks more than UNEVEN_LIMIT apart. Other processes on the cores take time from every composite of a round
    alike; a busy thread of this process, holding the GIL, delays every call that releases it, so a composite of
    more calls loses more, and the ratios move with the load."""
    shares = {t.name: statistics.median(t.ran) for t in timings.values() if t.ran}
    if len(shares) < 2 or min(shares.values()) <= 0:
        return []
    low, high = min(shares, key=shares.__getitem__), max(shares, key=shares.__getitem__)
    if shares[high] / shares[low] <= UNEVEN_LIMIT:
        return []
    return [f"the load fell unevenly on the composites ({low} ran {shares[low]:.0%} of the time it was timed, "
            f"{high} {shares[high]:.0%}): another busy thread of this process holds the GIL; re-run with no other "
            "busy thread in the profiling process"]


def contended(timings: Mapping[str, Timed], limit: float = CONTENDED_SHARE) -> list[str]:
    """Why these timings were taken under contention (empty when they were not): the timing thread ran less than
    ``limit`` of its blocks' wall time (the median over every block of every composite), so other processes or
    threads held the cores while it was timed. Per-round ratios shield a ranking from a load that only takes turns;
    a neighbour that shares the cores and their caches slows a memory-bound composite more than a compute-bound one,
    so such a ranking is re-measured, then refused, never stored."""
    shares = [share for t in timings.values() for share in t.ran]
    if not shares:
        return []
    share = statistics.median(shares)
    if share >= limit:
        return []
    return [f"measured under contention (the timing thread ran {share:.0%} of the wall time of its blocks, below "
            f"{limit:.0%}: other processes or threads held the cores); re-run where nothing else keeps the cores "
            "busy"]


def noise(*timings: Timed) -> float:
    """The relative difference below which two of these timings are not told apart."""
    return max([MIN_NOISE, *(t.spread for t in timings)])
