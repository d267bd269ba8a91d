"""``python -m bench.batch_rules [--batch 4 16 64] [--only NAME ...] [--rounds 7]``: what the C++ batching rules
(``registry/core/batch_rules.py``: the NLL loss and group norm) and group norm's C++ op (the ``cpp_op`` composite of
``native_group_norm``) change in whole per-sample-gradient steps.

Every ``bench.models`` workload runs inside ``use()`` two ways in one process, in alternating rounds (the order
alternating too): as ``use()`` runs it (``rules``), and with both switched off for that way's timing
(``overridden``: each rule runs the kernel it overrides, functorch's Python decomposition or C++ rule, and
``native_group_norm`` is pinned native: what ran before them). One intra-op thread, the calling thread's CPU time;
a way's time is its best round (each round the median call). Both ways' per-sample gradients are checked against
the per-sample loop.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import registry
from bench.models import all_workloads
from bench.models.__main__ import _matches, per_call_ms
from registry.core.routing import ROUTER


@contextlib.contextmanager
def switched_off(switch: Callable[[bool], None]) -> Iterator[None]:
    """``switch(False)`` while the block runs, ``switch(True)`` after it: a way's baseline in ``compare``."""
    switch(False)
    try:
        yield
    finally:
        switch(True)


def overridden() -> contextlib.AbstractContextManager[None]:
    """The C++ rules off while the block runs: each runs the kernel it overrides."""
    return switched_off(ROUTER.set_batch_rules_enabled)


BEFORE = {"native_group_norm": "native"}


def _inside_use(step: Callable[[], Any], pins: dict[str, str] | None = None) -> Callable[[], Any]:
    def inside() -> Any:
        with registry.use(pins=pins):
            return step()

    return inside


Switch = Callable[[], contextlib.AbstractContextManager[None]]


def run(name: str, build: Callable[[int], Any], batch: int, rounds: int, min_run_time: float, *,
        off: Switch = overridden, off_pins: dict[str, str] | None = None) -> dict[str, Any]:
    """One workload at one batch size inside ``use()``, with what is measured on and off (``off()`` around that
    way's calls, ``off_pins`` its pins), in alternating rounds of this process."""
    setup = build(batch)
    reference = setup.loop()
    step, before_step = _inside_use(setup.step), _inside_use(setup.step, off_pins)
    with off():
        before_ok = _matches(before_step(), reference, setup)
    after_ok = _matches(step(), reference, setup)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for round_number in range(rounds):  # the order alternates between rounds: neither way always runs first
        for way in ("off", "on") if round_number % 2 == 0 else ("on", "off"):
            with off() if way == "off" else contextlib.nullcontext():
                times[way].append(per_call_ms(before_step if way == "off" else step, time.thread_time,
                                              min_run_time))
    before, after = min(times["off"]), min(times["on"])
    return {"workload": name, "batch": batch, "off_ms": before, "on_ms": after, "speedup": before / after,
            "ok": before_ok and after_ok}


def compare(prog: str, description: str, argv: list[str] | None, labels: tuple[str, str], off: Switch,
            off_pins: dict[str, str] | None = None) -> None:
    """The command line of an on/off comparison over every ``bench.models`` workload (``labels``: the off and on
    columns' names)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--only", nargs="*", default=None, help="workload names (default: all)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if registry.routing_backend() != "cpp":
        parser.error("what this compares comes with the C++ routing kernels: build them with "
                     "`multicomposite build-kernels`")
    warnings.simplefilter("ignore")  # the models' own warnings (SDPA's fallback notes), once per call otherwise
    rows = []
    off_label, on_label = (f"{label} ms" for label in labels)
    print(f"{'workload':<34} {'batch':>5} {off_label:>14} {on_label:>14} {'speedup':>8}  per-sample grads")
    for workload in all_workloads():
        if args.only and workload.name not in args.only:
            continue
        for batch in args.batch:
            try:
                row = run(workload.name, workload.build, batch, args.rounds, args.min_run_time, off=off,
                          off_pins=off_pins)
            except Exception as error:  # a workload that fails natively too (or cannot be built) is reported
                print(f"{workload.name:<34} {batch:>5} {type(error).__name__}: {str(error)[:60]}")
                continue
            rows.append(row)
            print(f"{row['workload']:<34} {batch:>5} {row['off_ms']:>14.2f} {row['on_ms']:>14.2f} "
                  f"{row['speedup']:>7.3f}x  {'ok' if row['ok'] else 'MISMATCH'}")
    if rows:
        geomean = math.exp(sum(math.log(row["speedup"]) for row in rows) / len(rows))
        print(f"geomean speedup over {len(rows)} rows: {geomean:.3f}x "
              f"(range {min(r['speedup'] for r in rows):.3f}x - {max(r['speedup'] for r in rows):.3f}x)")


def main(argv: list[str] | None = None) -> None:
    compare("python -m bench.batch_rules", __doc__ or "", argv, ("overridden", "rules"), overridden, BEFORE)


if __name__ == "__main__":
    main()
