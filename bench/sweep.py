"""The default profiling sweep and what it buys: seven seed ops, every composite, workloads vmap, grad, vmap(grad),
jacrev, jacfwd and hessian, batch 32 and 256.

After profiling, ``auto`` (with those profiles) and native are re-timed side by side, in fresh measurements (best of
three alternating rounds), in every context: the geometric-mean speedup where native falls back (or errs, or is
wrong: there auto is also the only correct choice), and the worst ratio where native has a good batching rule
(target: at least 0.97).
"""

from __future__ import annotations

import math
import time
import warnings

import torch
from torch.utils.benchmark import Timer

import registry
from registry.core import rules
from registry.core.context import Context
from registry.core.ops import ORIGINAL
from registry.harness.samples import SAMPLES
from registry.profiling.timing import WORKLOADS, profile, seen_by_op, workload_case, workload_runner
from registry.store import evidence


def _median_us(run, min_run_time: float) -> float:
    timer = Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def sweep(batch_sizes=(32, 256), min_run_time: float = 0.1) -> dict[str, float]:
    start = time.perf_counter()
    profiles = profile(batch_sizes=batch_sizes, min_run_time=min_run_time)
    profiled = time.perf_counter() - start
    evidence.set_profiles(profiles)
    fallback_ratios, good_ratios = [], []
    worst = (math.inf, "")
    for op in SAMPLES:  # the seed ops: their cases are built from hand-written samples
        for workload in WORKLOADS:
            for batch in batch_sizes:
                size = 16 if workload in ("jacrev", "jacfwd", "hessian") else 1024
                native_case = workload_case(op, getattr(ORIGINAL.Tensor, op), size, batch, torch.float32, "cpu")
                stack, _ = seen_by_op(workload, native_case)
                native_run = workload_runner(workload, native_case)
                def routed(*args, op=op, **kwargs):  # looked up at call time: use() patches the method
                    return getattr(torch.Tensor, op)(*args, **kwargs)

                routed_run = workload_runner(workload, workload_case(op, routed, size, batch, torch.float32, "cpu"))
                # Three alternating rounds, best of each: on a shared machine noise only ever adds time.
                native_times, routed_times = [], []
                for _ in range(3):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        native_times.append(_median_us(native_run, min_run_time))
                    with registry.use():
                        routed_times.append(_median_us(routed_run, min_run_time))
                native_us, routed_us = min(native_times), min(routed_times)
                ratio = native_us / routed_us
                ctx = Context(stack=stack, tensors=registry.OPS[op].tensor_args,
                              batched=registry.OPS[op].tensor_args if "vmap" in stack else ())
                if rules.problem(op, "native", ctx) is not None:
                    fallback_ratios.append(ratio)
                else:
                    good_ratios.append(ratio)
                    with registry.use():
                        chosen = registry.select(op, stack=stack, batched=ctx.batched, dtype="float32",
                                                 numel=size).composite
                    worst = min(worst, (ratio, f"{op} {workload} batch {batch} (auto: {chosen}, native "
                                               f"{native_us:.0f} us, auto {routed_us:.0f} us)"))
    evidence.use_profile_loader(None)
    return {
        "profile_seconds": profiled,
        "total_seconds": time.perf_counter() - start,
        "fallback_contexts": len(fallback_ratios),
        "fallback_geomean": math.exp(sum(map(math.log, fallback_ratios)) / len(fallback_ratios)),
        "good_contexts": len(good_ratios),
        "good_worst": worst[0],
        "good_worst_where": worst[1],
        "good_geomean": math.exp(sum(map(math.log, good_ratios)) / len(good_ratios)),
    }


def print_sweep(min_run_time: float = 0.1) -> None:
    result = sweep(min_run_time=min_run_time)
    print(f"(d) profiling sweep (7 ops x 6 workloads x batch 32, 256, every composite): "
          f"{result['profile_seconds']:.0f} s (target <= 300 s)")
    print(f"    auto over native where native falls back, errs or is wrong ({result['fallback_contexts']} contexts): "
          f"geometric mean {result['fallback_geomean']:.2f}x")
    print(f"    auto over native where native is good ({result['good_contexts']} contexts): geometric mean "
          f"{result['good_geomean']:.2f}x, worst {result['good_worst']:.2f}x at {result['good_worst_where']} "
          f"(target >= 0.97)")


if __name__ == "__main__":
    print_sweep()
