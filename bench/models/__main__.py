"""``python -m bench.models [--batch 4 16 64] [--only NAME ...] [--rounds 5] [--clock cpu|wall|both] [--pins JSON]``:
native vs use() vs the DP library's hooks vs the per-sample loop, and each against the step's floor.

Every way runs in one process, in alternating rounds; a way's time is its best round (each round the median call).
``--clock cpu`` runs one intra-op thread and times the calling thread's CPU time (what time spent descheduled by
other processes does not inflate); ``--clock wall`` runs every thread and times wall time; ``both`` (the default)
runs the two one after the other. The floor is the workload's ordinary batched training step plus a fill of tensors
of its per-sample gradients' sizes (made once, written at each call), timed in the same rounds. ``--pins`` adds
``use(pins=...)`` as one more way in the same rounds (``pinned``: a baseline of earlier decisions, e.g. ``'{"mm":
"native"}'``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten  # noqa: PLC2701 - PyTorch's pytree

import registry
from bench.models import Setup, Workload, all_workloads
from bench.models.dp import opacus_missing
from registry.core import kernels
from registry.core.messages import described
from registry.harness.fallback import FALLBACK_WARNING

CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}
WAYS = ("native", "use", "hooks", "loop", "batched", "fill")


def per_call_ms(stmt: Callable[[], object], clock: Callable[[], float], min_run_time: float) -> float:
    """The median time of one call of ``stmt``, over at least 3 calls and ``min_run_time`` seconds."""
    times: list[float] = []
    while len(times) < 3 or (sum(times) < min_run_time and len(times) < 1000):
        start = clock()
        stmt()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def _attempt(stmt: Callable[[], Any]) -> tuple[Any, int, str | None]:
    """(result, fallback warnings, first line of the error or None)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = stmt()
        except Exception as error:  # a workload that fails is reported, not a crash of the whole bench
            return None, 0, described(error)[:120]
    return result, sum(FALLBACK_WARNING in str(w.message) for w in caught), None


def _matches(result: Any, reference: Any, setup: Setup) -> bool:
    got, _ = tree_flatten(result)
    want, _ = tree_flatten(reference)
    if len(got) != len(want):
        return False
    return all(g.shape == w.shape and torch.allclose(g, w, rtol=setup.rtol, atol=setup.atol)
               for g, w in zip(got, want, strict=True))


def _routed(stmt: Callable[[], Any], pins: dict[str, str] | None = None) -> Callable[[], Any]:
    def inside() -> Any:
        with registry.use(pins=pins):
            return stmt()

    return inside


def _fill(reference: Any) -> Callable[[], object]:
    """Tensors of the per-sample gradients' sizes, each written once: the floor's second part.

    They are made once and written at every call: memory kept mapped, as the output pool keeps what use()'s kernels
    write per-sample gradients into (``registry/core/kernels/output_pool.cpp``). Fresh tensors would add the page
    faults of the allocator's fresh memory, an allocator's cost and not the step's (82 MB of an embedding table's
    per-sample gradients at batch 64: 34 ms fresh, against a few ms written in place). They are written as fast as
    this machine writes memory: with the streaming stores use()'s kernels write large per-sample gradients with,
    where the kernels are built (82 MB: 1.2 ms, against 3.7 ms for ``fill_``), else ``zero_``."""
    targets = [torch.empty(t.shape, dtype=t.dtype) for t in tree_flatten(reference)[0]]
    write = torch.ops.multicomposite.zero_streaming_ if kernels.fused_ops_available() else torch.Tensor.zero_
    return lambda: [write(t) for t in targets]


def run(workload: Workload, batch: int, rounds: int, min_run_time: float, clock: str,
        pins: dict[str, str] | None = None) -> dict[str, Any]:
    """One workload at one batch size: each way checked against the loop once, then timed in alternating rounds."""
    row: dict[str, Any] = {"workload": workload.name, "family": workload.family, "batch": batch, "clock": clock}
    try:
        setup = workload.build(batch)
    except Exception as error:  # a model that cannot be built here (a library missing) is reported
        row.update(native=described(error)[:120], use="-", hooks="-")
        return row
    reference = setup.loop()
    stmts: dict[str, Callable[[], Any]] = {"native": setup.step, "use": _routed(setup.step), "loop": setup.loop}
    if pins:
        stmts["pinned"] = _routed(setup.step, pins)
    for way in ("native", "use", "pinned", "hooks") if pins else ("native", "use", "hooks"):
        stmt = stmts.get(way) if way != "hooks" else setup.hooks
        if stmt is None:
            row[way] = "-"
            continue
        result, fallbacks, error = _attempt(stmt)
        row[way] = error or ("ok" if _matches(result, reference, setup) else "mismatch")
        row[f"{way}_fallbacks"] = fallbacks
        if error is None:
            stmts[way] = stmt
        else:
            stmts.pop(way, None)
    if setup.batched is not None:
        stmts["batched"], stmts["fill"] = setup.batched, _fill(reference)
    times: dict[str, list[float]] = {way: [] for way in stmts}
    timer = CLOCKS[clock]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            for way, stmt in stmts.items():
                times[way].append(per_call_ms(stmt, timer, min_run_time))
    for way, each in times.items():
        row[f"{way}_ms"] = min(each)
    if "batched_ms" in row:
        row["floor_ms"] = row["batched_ms"] + row["fill_ms"]
    return row


def _ratio(row: dict[str, Any], top: str, bottom: str) -> str:
    return f"{row[top] / row[bottom]:.2f}x" if top in row and bottom in row else "-"


def _ms(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


HEADER = (f"{'workload':32} {'batch':>5} {'native':>8} {'use()':>8} {'hooks':>8} {'native ms':>9} {'use ms':>8}"
          f" {'hooks ms':>8} {'floor ms':>8} {'loop ms':>8} {'use/floor':>9} {'native/use':>10} {'hooks/use':>9}")
PINNED = f" {'pinned ms':>9} {'pinned/use':>10}"


def line(row: dict[str, Any]) -> str:
    text = (f"{row['workload'][:32]:32} {row['batch']:>5} {row['native'][:8]:>8} {row['use'][:8]:>8}"
            f" {row['hooks'][:8]:>8} {_ms(row, 'native_ms'):>9} {_ms(row, 'use_ms'):>8} {_ms(row, 'hooks_ms'):>8}"
            f" {_ms(row, 'floor_ms'):>8} {_ms(row, 'loop_ms'):>8} {_ratio(row, 'use_ms', 'floor_ms'):>9}"
            f" {_ratio(row, 'native_ms', 'use_ms'):>10} {_ratio(row, 'hooks_ms', 'use_ms'):>9}")
    if "pinned" in row:
        text += f" {_ms(row, 'pinned_ms'):>9} {_ratio(row, 'pinned_ms', 'use_ms'):>10}"
    return text


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The targets' lines: use() over its floor (each, geomean), against the hooks, against native."""
    floors = [r["use_ms"] / r["floor_ms"] for r in rows if "use_ms" in r and "floor_ms" in r]
    natives = [r["native_ms"] / r["use_ms"] for r in rows if "use_ms" in r and "native_ms" in r]
    hooked = [r for r in rows if "use_ms" in r and "hooks_ms" in r]
    slower = [f"{r['workload']}@{r['batch']}" for r in hooked if r["use_ms"] > r["hooks_ms"]]
    over = [f"{r['workload']}@{r['batch']}" for r in rows if "floor_ms" in r and r["use_ms"] > 2 * r["floor_ms"]]
    pinned = [r["pinned_ms"] / r["floor_ms"] for r in rows if "pinned_ms" in r and "floor_ms" in r]
    hooks_pinned = [r for r in hooked if "pinned_ms" in r]
    before = [f"use(pins)/floor: geomean {_geomean(pinned):.2f}x over {len(pinned)}; as fast as the hooks on "
              f"{sum(r['pinned_ms'] <= r['hooks_ms'] for r in hooks_pinned)} of {len(hooks_pinned)}"] if pinned else []
    return [*before,
        f"use()/floor: geomean {_geomean(floors):.2f}x over {len(floors)} (target 1.5x); above 2x: "
        f"{', '.join(over) or 'none'}",
        f"use() at least as fast as the hooks on {len(hooked) - len(slower)} of {len(hooked)}; slower: "
        f"{', '.join(slower) or 'none'}",
        f"native/use(): geomean {_geomean(natives):.2f}x over {len(natives)}, lowest "
        f"{min(natives, default=float('nan')):.2f}x",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16, 64], help="batch sizes (default 4 16 64)")
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default 5)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing (default 0.2)")
    parser.add_argument("--clock", choices=("cpu", "wall", "both"), default="both",
                        help="cpu: one thread, thread CPU time; wall: all threads, wall time (default both)")
    parser.add_argument("--pins", type=json.loads, default=None,
                        help="also time use(pins=PINS) in the same rounds, a JSON object op -> kind or composite")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    workloads = [w for w in all_workloads() if args.only is None or w.name in args.only]
    missing = opacus_missing()
    if missing is not None:
        print(f"no hooks column: {missing}")
    threads = torch.get_num_threads()
    for clock in (("cpu", "wall") if args.clock == "both" else (args.clock,)):
        torch.set_num_threads(1 if clock == "cpu" else threads)
        what = "one thread, thread CPU time" if clock == "cpu" else f"{threads} threads, wall time"
        print(f"torch {torch.__version__}, {what}, best of {args.rounds} alternating rounds (each the median call)")
        print(HEADER + (PINNED if args.pins else ""))
        if args.pins:
            print(f"pinned: use(pins={args.pins})")
        rows = []
        for batch in args.batch:
            for workload in workloads:
                row = run(workload, batch, args.rounds, args.min_run_time, clock, args.pins)
                rows.append(row)
                print(line(row), flush=True)
                for way in ("native", "use", "pinned", "hooks"):
                    if row.get(way, "-") not in ("ok", "mismatch", "-"):
                        print(f"    {way}: {row[way]}")
        for text in summary(rows):
            print(text)
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
