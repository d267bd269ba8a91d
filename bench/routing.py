"""What routing at the dispatcher costs, on each backend, measured side by side in one process
(``python -m bench.routing``; ``python -m bench`` runs it too).

(r0) outside ``use()``: a vmap(grad(f)) of a covered op (index_add, batch 8, 6 x 64) with the routing kernels
     registered vs with none (target >= 0.99x); in a fresh process, where the routing kernels are registered and
     removed between rounds (the dynamic-shape refusals' kernels stay: they are not on this path)
(r1) ``with use(): pass`` — construction, enter and exit — over an empty with-statement (target <= 1 us)
(r2) a whole ``vmap(grad(f))`` call whose covered op runs PyTorch's own kernel: index_add, batch 8, 6 x 64, inside
     vs outside ``use()`` (target >= 0.98x native)
(r3) a routed op over its composite called directly: masked_scatter, batch 8, 5 x 4, inside ``use()`` (functional
     pinned) vs the functional composite under the same transform outside, under vmap and vmap(grad) (target
     <= 5 us added); on the C++ backend also masked_fill's cpp_op, which the routing redirects to its entry op
     without Python, routed vs that entry op called directly outside ``use()``
(r4) eager, no transform: a covered op (index_add) and an uncovered one (add) inside vs outside ``use()``
     (targets <= 0.5 us and 0 added)
(r5) the per-sample-gradient steps of ``bench.models`` (transformers with SDPA, attention, LSTM) inside
     ``use(policy="native")``, where every decision is PyTorch's own kernel, vs natively (target >= 0.99x): every
     entry of a covered op still builds its decision key and looks it up at each functorch layer; the
     models that fail natively (GRU, message passing) are left out, as there is no native time to compare with

``--breakdown`` takes (r3) apart: the composite called directly outside and inside ``use()``, and the routed op, in
short blocks alternated many times (the median of the per-round differences: what a shared machine's drift does not
move), with the Python calls and the decided kernel calls of one call.

Each pair is timed in alternating rounds (``torch.utils.benchmark.Timer.blocked_autorange``); the minimum over rounds
is reported, since on a shared machine noise only ever adds time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import func
from torch.utils.benchmark import Timer

import registry
from registry.core import kernels, routing

BACKENDS = ("cpp", "python")


CLOCK_ENV = "BENCH_ROUTING_CLOCK"  # "thread": the calling thread's CPU time (set by --cpu-time, read by (r0)'s child)


def _us(stmt: Callable[[], object], min_run_time: float) -> float:
    clock = time.thread_time if os.environ.get(CLOCK_ENV) == "thread" else time.perf_counter
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads(), timer=clock)
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def _pair(outside: Callable[[], object], inside: Callable[[], object], rounds: int, min_run_time: float,
          inside_use: bool = True, pins: dict[str, str] | None = None, policy: str = "auto") -> tuple[float, float]:
    """(outside, inside) microseconds, min over alternating rounds; ``inside`` runs within ``use(policy, pins)``."""
    outside_times, inside_times = [], []
    for _ in range(rounds):
        outside_times.append(_us(outside, min_run_time))
        with registry.use(policy=policy, pins=pins) if inside_use else contextlib.nullcontext():
            inside_times.append(_us(inside, min_run_time))
    return min(outside_times), min(inside_times)


def _index_add_vmap_grad() -> tuple[Callable[[torch.Tensor], Any], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 64, generator=generator)
    index = torch.tensor([0, 2, 5, 1])
    source = torch.randn(4, 64, generator=generator)

    def loss(row: torch.Tensor) -> torch.Tensor:
        return row.index_add(0, index, source * row[:4]).pow(2).sum()

    return func.vmap(func.grad(loss)), x


def bench_outside_registered(rounds: int, min_run_time: float, backend: str) -> dict[str, float]:
    """(r0), in a fresh process: no kernel has been registered there before it starts."""
    code = f"from bench.routing import _outside_child; _outside_child({rounds}, {min_run_time}, {backend!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, routing.BACKEND_ENV: backend})
    if done.returncode != 0:
        raise RuntimeError(f"(r0) child process failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _outside_child(rounds: int, min_run_time: float, backend: str) -> None:
    if os.environ.get(CLOCK_ENV) == "thread":
        torch.set_num_threads(1)
    per_sample_grads, x = _index_add_vmap_grad()
    per_sample_grads(x)
    registry.register_kernels()
    if routing.routing_backend() != backend:
        raise RuntimeError(f"asked for the {backend} backend, got {routing.routing_backend()}")
    registered, unregistered = [], []
    for _ in range(rounds):
        registered.append(_us(lambda: per_sample_grads(x), min_run_time))
        routing.set_routing_kernels(False)
        unregistered.append(_us(lambda: per_sample_grads(x), min_run_time))
        routing.set_routing_kernels(True)
    before, after = min(unregistered), min(registered)
    print(json.dumps({"unregistered_us": before, "registered_us": after, "ratio": before / after}))


def bench_enter_exit(rounds: int, min_run_time: float) -> dict[str, float]:
    def empty() -> None:
        with contextlib.nullcontext():
            pass

    def enter_exit() -> None:
        with registry.use():
            pass

    baseline, routed = _pair(empty, enter_exit, rounds, min_run_time, inside_use=False)
    return {"enter_exit_us": routed, "nullcontext_us": baseline, "added_us": routed - baseline}


def bench_vmap_grad_native(rounds: int, min_run_time: float) -> dict[str, Any]:
    per_sample_grads, x = _index_add_vmap_grad()
    with registry.use():
        torch.testing.assert_close(per_sample_grads(x), per_sample_grads(x))
    decision = registry.select("index_add", stack="vmap,grad", batched=["self", "source"], dtype="float32")
    native, routed = _pair(lambda: per_sample_grads(x), lambda: per_sample_grads(x), rounds, min_run_time)
    return {"native_us": native, "routed_us": routed, "ratio": native / routed, "composite": decision.composite}


def _masked_scatter_cases() -> tuple[dict[str, tuple[Callable[..., Any], Callable[..., Any]]], tuple[torch.Tensor, ...],
                                       dict[str, str]]:
    """(r3)'s calls: per stack, (the functional composite under the transform, the routed op under it); the
    arguments; the pins that route masked_scatter to that composite."""
    generator = torch.Generator().manual_seed(0)
    x, source = torch.randn(8, 5, 4, generator=generator), torch.randn(8, 5, 4, generator=generator)
    mask = torch.rand(8, 5, 4, generator=generator) > 0.5
    functional = registry.composites("masked_scatter")["functional"].fn
    pins = {"masked_scatter": "functional"}  # the same composite both ways, whatever the profiles would pick

    def op_loss(s: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return s.masked_scatter(m, v).pow(2).sum()

    def composite_loss(s: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return functional(s, m, v).pow(2).sum()

    cases = {
        "vmap": (func.vmap(functional), func.vmap(lambda s, m, v: s.masked_scatter(m, v))),
        "vmap(grad)": (func.vmap(func.grad(composite_loss, argnums=(0, 2))),
                       func.vmap(func.grad(op_loss, argnums=(0, 2)))),
    }
    return cases, (x, mask, source), pins


def bench_routed_over_composite(rounds: int, min_run_time: float) -> dict[str, dict[str, float]]:
    cases, (x, mask, source), pins = _masked_scatter_cases()
    results = {}
    for stack, (direct, routed) in cases.items():
        with registry.use(pins=pins):
            torch.testing.assert_close(routed(x, mask, source), direct(x, mask, source))
        direct_us, routed_us = _pair(lambda d=direct: d(x, mask, source), lambda r=routed: r(x, mask, source),
                                     rounds, min_run_time, pins=pins)
        results[stack] = {"composite_us": direct_us, "routed_us": routed_us, "added_us": routed_us - direct_us}
    return results


def bench_redirected(rounds: int, min_run_time: float) -> dict[str, dict[str, float]] | None:
    """(r3) for a composite the C++ routing redirects to (masked_fill's cpp_op, its entry op
    ``multicomposite::masked_fill``): the routed op inside ``use()`` vs the entry op called directly outside, under
    vmap(grad), batch 8, 5 x 4. None where the C++ ops are not built."""
    if not kernels.fused_ops_available():
        return None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 4, generator=generator)
    mask, value = torch.rand(8, 5, 4, generator=generator) > 0.5, torch.randn(8, generator=generator)
    entry = torch.ops.multicomposite.masked_fill.Tensor
    direct = func.vmap(func.grad(lambda s, m, v: entry(s, m, v).pow(2).sum(), argnums=(0, 2)))
    routed = func.vmap(func.grad(lambda s, m, v: s.masked_fill(m, v).pow(2).sum(), argnums=(0, 2)))
    pins = {"masked_fill": "cpp_op"}
    with registry.use(pins=pins):
        torch.testing.assert_close(routed(x, mask, value), direct(x, mask, value))
    direct_us, routed_us = _pair(lambda: direct(x, mask, value), lambda: routed(x, mask, value), rounds,
                                 min_run_time, pins=pins)
    return {"vmap(grad)": {"composite_us": direct_us, "routed_us": routed_us, "added_us": routed_us - direct_us}}


def _python_calls(call: Callable[[], object]) -> int:
    """Python functions and C functions called from Python during one ``call()`` (``sys.setprofile``)."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    call()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count - 1  # setprofile(None) itself


def _paired_median(first: list[float], second: list[float]) -> float:
    """The median of the per-round differences: drift that moves both of a round's blocks cancels."""
    return statistics.median(a - b for a, b in zip(first, second, strict=True))


def breakdown(rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """(r3) taken apart, per stack: the composite called directly outside and inside ``use()`` and the routed op
    inside, timed in blocks of ``calls`` calls alternated ``rounds`` times (order reversed every other round), the
    collector off; each difference is the median of the per-round differences."""
    clock = time.thread_time_ns if os.environ.get(CLOCK_ENV) == "thread" else time.perf_counter_ns
    cases, args, pins = _masked_scatter_cases()
    inside = registry.use(pins=pins)
    results = {}
    for stack, (direct, routed) in cases.items():
        variants: dict[str, tuple[Callable[..., Any], bool]] = {
            "direct_outside": (direct, False), "direct_inside": (direct, True), "routed_inside": (routed, True)}

        counts: dict[str, float] = {}
        for name, (fn, in_use) in variants.items():
            recording = registry.use(pins=pins, record=True)
            with recording if in_use else contextlib.nullcontext():  # outside use() no kernel decides anything
                fn(*args)
            counts[f"{name}_decided_kernel_calls"] = sum(recording.calls.values()) if in_use else 0
            with inside if in_use else contextlib.nullcontext():
                fn(*args)
                counts[f"{name}_python_calls"] = _python_calls(lambda f=fn: f(*args))
        times: dict[str, list[float]] = {name: [] for name in variants}
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for r in range(rounds):
                for name in variants if r % 2 == 0 else reversed(variants):
                    fn, in_use = variants[name]
                    with inside if in_use else contextlib.nullcontext():
                        start = clock()
                        for _ in range(calls):
                            fn(*args)
                        times[name].append((clock() - start) / calls / 1e3)
        finally:
            if collecting:
                gc.enable()

        results[stack] = {"direct_outside_us": statistics.median(times["direct_outside"]),
                          "inside_use_us": _paired_median(times["direct_inside"], times["direct_outside"]),
                          "routed_call_us": _paired_median(times["routed_inside"], times["direct_inside"]),
                          "routed_over_direct_outside_us": _paired_median(times["routed_inside"],
                                                                          times["direct_outside"]), **counts}
    return results


def print_breakdown(backend: str, results: dict[str, dict[str, float]]) -> None:
    print(f"backend {backend}: (r3) taken apart (medians of per-round differences)")
    for stack, r in results.items():
        print(f"  {stack}: composite called directly outside use() {r['direct_outside_us']:.1f} us; the same call "
              f"inside use() {r['inside_use_us']:+.2f} us; the routed op over the direct call inside use() "
              f"{r['routed_call_us']:+.2f} us; routed over direct outside (what (r3) reports) "
              f"{r['routed_over_direct_outside_us']:+.2f} us")
        print(f"    Python calls per call: direct outside {r['direct_outside_python_calls']}, inside "
              f"{r['direct_inside_python_calls']}, routed {r['routed_inside_python_calls']}; decided kernel calls: "
              f"direct {r['direct_inside_decided_kernel_calls']}, routed {r['routed_inside_decided_kernel_calls']}")


def bench_eager(rounds: int, min_run_time: float) -> dict[str, float]:
    a, b = torch.randn(8), torch.randn(8)
    x, index, source = torch.randn(8, 4), torch.tensor([0, 3]), torch.randn(2, 4)
    add_out, add_in = _pair(lambda: torch.add(a, b), lambda: torch.add(a, b), rounds, min_run_time)
    covered_out, covered_in = _pair(lambda: x.index_add(0, index, source), lambda: x.index_add(0, index, source),
                                    rounds, min_run_time)
    return {"uncovered_native_us": add_out, "uncovered_added_us": add_in - add_out,
            "covered_native_us": covered_out, "covered_added_us": covered_in - covered_out}


def bench_models_native(rounds: int, min_run_time: float, batch: int) -> dict[str, dict[str, Any]]:
    """(r5): each bench.models workload that runs natively, inside ``use(policy="native")`` vs outside. (Pinning
    every op to native would refuse where native is invalid, as under LSTM's vmap(grad).)"""
    import warnings

    from bench.models import all_workloads

    results: dict[str, dict[str, Any]] = {}
    for workload in all_workloads():
        setup = workload.build(batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # native's loop warnings: the same both ways
            try:
                expected = setup.step()
            except Exception:  # fails natively (GRU, message passing): no native time to compare with
                continue
            with registry.use(policy="native"):
                torch.testing.assert_close(setup.step(), expected)
            # A step takes 8-250 ms: at least a second a block, so that each median is over several steps.
            native, routed = _pair(setup.step, setup.step, rounds, max(min_run_time, 1.0), policy="native")
        results[workload.name] = {"native_us": native, "routed_us": routed, "ratio": native / routed}
    return results


def measure(rounds: int, min_run_time: float, backend: str, outside: bool = True,
            models_batch: int | None = 64) -> dict[str, Any]:
    """Every measurement on ``backend``; ``outside``: also (r0), which starts a process of its own; ``models_batch``:
    (r5) at that batch size (None: skipped)."""
    routing.set_routing_backend(backend)
    results: dict[str, Any] = {}
    if outside:
        results["outside_registered"] = bench_outside_registered(rounds, min_run_time, backend)
    results["enter_exit"] = bench_enter_exit(rounds, min_run_time)
    results["vmap_grad_native"] = bench_vmap_grad_native(rounds, min_run_time)
    results["routed_over_composite"] = bench_routed_over_composite(rounds, min_run_time)
    if backend == "cpp":  # the redirect is the C++ routing's
        results["redirected"] = bench_redirected(rounds, min_run_time)
    results["eager"] = bench_eager(rounds, min_run_time)
    if models_batch is not None:
        results["models_native"] = bench_models_native(rounds, min_run_time, models_batch)
    return results


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def print_results(backend: str, results: dict[str, Any]) -> None:
    print(f"backend {backend}:")
    if "outside_registered" in results:
        r = results["outside_registered"]
        print(f"  (r0) outside use(), vmap(grad) index_add: no kernels {r['unregistered_us']:.1f} us, kernels "
              f"registered {r['registered_us']:.1f} us -> {r['ratio']:.3f}x (target >= 0.99x) "
              f"{_verdict(r['ratio'] >= 0.99)}")
    r = results["enter_exit"]
    print(f"  (r1) with use(): pass  {r['enter_exit_us']:.2f} us, {r['added_us']:+.2f} us over an empty "
          f"with-statement ({r['nullcontext_us']:.2f} us; target <= 1 us) {_verdict(r['added_us'] <= 1.0)}")
    r = results["vmap_grad_native"]
    print(f"  (r2) vmap(grad(f)), index_add runs {r['composite']}, batch 8, 6 x 64: native {r['native_us']:.1f} us, "
          f"inside use() {r['routed_us']:.1f} us -> {r['ratio']:.3f}x native (target >= 0.98x) "
          f"{_verdict(r['ratio'] >= 0.98)}")
    for stack, r in results["routed_over_composite"].items():
        print(f"  (r3) masked_scatter under {stack}, batch 8, 5 x 4: functional composite {r['composite_us']:.1f} us, "
              f"routed inside use() {r['routed_us']:.1f} us -> {r['added_us']:+.2f} us (target <= 5 us) "
              f"{_verdict(r['added_us'] <= 5.0)}")
    for stack, r in (results.get("redirected") or {}).items():
        print(f"  (r3) masked_fill's cpp_op under {stack}, batch 8, 5 x 4 (redirected: no Python): its entry op "
              f"called directly {r['composite_us']:.1f} us, routed inside use() {r['routed_us']:.1f} us -> "
              f"{r['added_us']:+.2f} us (target <= 5 us) {_verdict(r['added_us'] <= 5.0)}")
    r = results["eager"]
    print(f"  (r4) eager inside use(): covered index_add {r['covered_added_us']:+.2f} us (native "
          f"{r['covered_native_us']:.2f} us; target <= 0.5 us) {_verdict(r['covered_added_us'] <= 0.5)}, "
          f"uncovered add {r['uncovered_added_us']:+.2f} us (native {r['uncovered_native_us']:.2f} us; target 0)")
    for name, r in results.get("models_native", {}).items():
        print(f"  (r5) {name}, policy native: native "
              f"{r['native_us'] / 1e3:.2f} ms, inside use() {r['routed_us'] / 1e3:.2f} ms -> {r['ratio']:.3f}x "
              f"(target >= 0.99x) {_verdict(r['ratio'] >= 0.99)}")


def on_each_backend(backends: tuple[str, ...], run: Callable[[str], dict[str, Any]],
                    show: Callable[[str, dict[str, Any]], None]) -> dict[str, dict[str, Any]]:
    """``run(backend)`` with each of ``backends`` active, then ``show`` its result; the active backend is restored
    after."""
    active = routing.routing_backend()
    results = {}
    try:
        for backend in backends:
            routing.set_routing_backend(backend)
            results[backend] = run(backend)
            show(backend, results[backend])
    finally:
        routing.set_routing_backend(active)
    return results


def print_routing(rounds: int, min_run_time: float, backends: tuple[str, ...] = BACKENDS,
                  outside: bool = True, models_batch: int | None = 64) -> dict[str, dict[str, Any]]:
    """Measure and print every backend in ``backends``; the active backend is restored after."""
    return on_each_backend(backends, lambda backend: measure(rounds, min_run_time, backend, outside, models_batch),
                           print_results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per pair")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per blocked_autorange")
    parser.add_argument("--backend", choices=BACKENDS, action="append",
                        help="only this backend (repeatable; default: both)")
    parser.add_argument("--no-outside", action="store_true", help="skip (r0), which starts a process per backend")
    parser.add_argument("--models-batch", type=int, default=64, help="(r5)'s batch size (default 64, as bench.models)")
    parser.add_argument("--no-models", action="store_true", help="skip (r5), the whole model steps")
    parser.add_argument("--json", action="store_true", help="also print every number as one JSON object")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed in thread CPU time (a shared machine: time spent descheduled does "
                             "not count)")
    parser.add_argument("--breakdown", action="store_true",
                        help="only (r3), taken apart: inside use() vs outside, the routed call vs the direct one")
    parser.add_argument("--breakdown-rounds", type=int, default=40, help="alternated blocks per variant")
    parser.add_argument("--breakdown-calls", type=int, default=100, help="calls per block")
    args = parser.parse_args(argv)
    if args.cpu_time:
        os.environ[CLOCK_ENV] = "thread"
        os.environ["OMP_NUM_THREADS"] = "1"  # (r0)'s child too
        torch.set_num_threads(1)
    if args.breakdown:
        taken_apart = on_each_backend(tuple(args.backend or BACKENDS),
                                      lambda _backend: breakdown(args.breakdown_rounds, args.breakdown_calls),
                                      print_breakdown)
        if args.json:
            print(json.dumps(taken_apart))
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    results = print_routing(args.rounds, args.min_run_time, tuple(args.backend or BACKENDS), not args.no_outside,
                            None if args.no_models else args.models_batch)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
