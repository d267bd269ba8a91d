"""Timings that noise cannot fool: composites timed in interleaved rounds in one process, with their spread, and the
tests that say a context was disturbed and must be re-measured (or not stored at all).

On a shared machine noise only ever adds time, and it comes in bursts (another process's compile, a server's
request): timing native for a second, then each composite for a second, lets a burst land on one of them and flip a
decision. Interleaved rounds (native, a, b, native, a, b, ... with the order rotated each round) spread a burst over
every composite, and the spread across rounds (IQR over median) says whether one came at all.
"""

from __future__ import annotations

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


@dataclass
class Timed:
    """One composite's per-call times over interleaved rounds, in microseconds."""

    name: str
    rounds_us: list[float] = field(default_factory=list)
    calls: int = 0
    first_call_us: float = 0.0  # the first call, which includes any compilation (fused kernels, Inductor)

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


def _per_call(run: Callable[[], Any], number: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(number):
        run()
    return (clock() - start) / number * 1e6


def interleaved(runners: Mapping[str, Callable[[], Any]], *, rounds: int = ROUNDS, min_run_time: float = 0.1,
                clock: Callable[[], float] = time.perf_counter,
                timed: Mapping[str, Timed] | None = None) -> dict[str, Timed]:
    """Each runner's per-call time in ``rounds`` interleaved rounds (the order rotated every round), each round a
    block of calls lasting about ``min_run_time / rounds`` seconds. ``timed`` (earlier rounds) is extended."""
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
        single = _per_call(runners[name], 1, clock) / 1e6
        numbers[name] = max(1, int(block / max(single, 1e-7)))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].rounds_us.append(_per_call(runners[name], numbers[name], clock))
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


def noise(*timings: Timed) -> float:
    """The relative difference below which two of these timings are not told apart."""
    return max([MIN_NOISE, *(t.spread for t in timings)])
