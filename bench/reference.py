"""``python -m bench.reference measure``: the reference profiles shipped in the package
(``registry/core/reference_profiles.json``), which rank the valid composites where no local profile does.

``measure`` profiles the seed ops' hand-made workloads (batch 256 x 1,000 elements, float32; vmap, grad and
vmap(grad) unless ``--workload`` names others) with
``registry.profiling.timing.profile`` in thread CPU time on one thread (interleaved rounds, each composite checked
against the reference first, a disturbed context re-measured) and writes each context's valid composites' median
times, with the machine's name.

``check`` is the acceptance test: on an empty store (a temporary one), masked_scatter, masked_fill (Tensor value)
and index_fill (Tensor value) under vmap(grad) at batch 256 x 1,000, auto inside ``use()`` against every valid
composite pinned, timed side by side in interleaved rounds in this process: auto's time over the fastest one's,
the target at most 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import func

from bench.size_grids import GRIDS, OPINFO_GRID_OPS, SizeGrid, grid_of, runnable

OPS = ("masked_scatter", "masked_fill", "index_fill", "index_add", "index_copy", "contiguous", "to")
CHECKED = ("masked_scatter", "masked_fill", "index_fill")
NUMEL, BATCH = 1000, 256
TARGET = 1.10
WORKLOADS = ("vmap", "grad", "vmap(grad)", "jacrev", "jacfwd", "hessian")
# The stacks a new user's batched code reaches most: vmap, grad over a vmapped loss, per-sample gradients.
DEFAULT_WORKLOADS = ("vmap", "grad", "vmap(grad)")


def machine_name() -> str:
    """``2-core x86_64 (model), torch 2.13.0 CPU``: the machine a reference was measured on."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    cores = os.cpu_count() or 1
    where = f" ({model})" if model else ""
    return f"{cores}-core {platform.machine()}{where}, torch {torch.__version__.split('+')[0]} CPU"


def measure(path: Path, min_run_time: float, workloads: list[str]) -> dict[str, Any]:
    """One thread, thread CPU time (as ``sizes``): what other processes' load and the machine's core count move
    least; a context on which that load still fell is re-measured, then refused (``profile``)."""
    from registry.profiling.timing import WORKLOAD_BATCHED, profile

    torch.set_num_threads(1)
    refused: list[str] = []
    entries = profile(ops=OPS, workloads=workloads, numels=(NUMEL,), batch_sizes=(BATCH,), dtypes=(torch.float32,),
                      min_run_time=min_run_time, earlier=[], refused=refused, clock=time.thread_time)
    contexts: dict[tuple[str, tuple[str, ...], str, str], dict[str, Any]] = {}
    for entry in entries:
        if not entry.valid or entry.median_us is None:
            continue
        key = (entry.op, tuple(entry.stack), entry.dtype, entry.workload)
        context = contexts.setdefault(key, {"op": entry.op, "stack": list(entry.stack), "dtype": entry.dtype,
                                            "workload": entry.workload, "numel": NUMEL, "batch": entry.batch_size,
                                            "batched": list(WORKLOAD_BATCHED[entry.op]), "times_us": {}})
        context["times_us"][entry.composite] = round(entry.median_us, 2)
    document = {"machine": machine_name(), "measured_by": "python -m bench.reference measure",
                "clock": "thread CPU time, one thread; interleaved rounds, ranked by median per-round ratio",
                "contexts": sorted(contexts.values(), key=lambda c: (c["op"], c["workload"]))}
    path.write_text(json.dumps(document, indent=1) + "\n")
    for line in refused:
        print(f"refused: {line}", file=sys.stderr)
    return document


# The reference costs by size (``sizes``): each op of bench/size_grids.py on its grid, under vmap and vmap(grad);
# native twice where the C++ routing backend has a batching rule of this package for the op's kernel: in vmap's
# loop and with that rule.
SIZES_WORKLOADS = {"vmap": ("vmap",), "vmap(grad)": ("vmap", "grad")}
SIZES_ATTEMPTS = 3  # a point measured under contention is re-measured (after a pause) this many times in all
SIZES_RULES = ("scaled_dot_product_attention",)  # the ops whose kernels registry.core.batch_rules folds


def _size_runners(grid: SizeGrid, at: dict[str, int], fixed: dict[str, Any], workload: str,
                  composites: list[str]) -> dict[str, Any]:
    import registry
    from registry.core.cost import NATIVE_BATCH_RULES

    forward, inputs, differentiable = grid.inputs(at, fixed, torch.Generator().manual_seed(0))
    run = runnable(forward, differentiable, workload, grid.shared, len(inputs))

    def routed(composite: str) -> Any:
        # Native too inside use(), with policy native (nothing routed, its derivative ops included, PyTorch's own
        # batching rules: vmap's loop): use()'s own cost on entry is paid by every runner alike, so the ratios are
        # the op's. NATIVE_BATCH_RULES is PyTorch's kernel pinned, with this package's C++ batching rules.
        if composite == "native":
            within: dict[str, Any] = {"policy": "native"}
        else:
            within = {"pins": {grid.op: "native" if composite == NATIVE_BATCH_RULES else composite}}

        def call() -> Any:
            with registry.use(**within):
                return run(*inputs)
        return call

    runners = {c: routed(c) for c in composites}
    for composite, run_it in list(runners.items()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # vmap's loop, natively
                run_it()
        except registry.SelectionError:  # not valid in this context (a custom_op under grad): nothing to time
            del runners[composite]
    return runners


def _measure_point(runners: dict[str, Any], rounds: int, min_run_time: float) -> tuple[float, dict[str, Any]]:
    """The point's timings, re-measured (after a pause) while contended; the least contended attempt."""
    from registry.profiling import noise

    best: tuple[float, dict[str, noise.Timed]] | None = None
    for attempt in range(SIZES_ATTEMPTS):
        if attempt:
            time.sleep(attempt)  # let another process's burst pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            timed = noise.interleaved(runners, rounds=rounds, min_run_time=min_run_time, clock=time.thread_time,
                                      wall_clock=time.monotonic)
        share = statistics.median(s for t in timed.values() for s in t.ran)
        if best is None or share > best[0]:
            best = (share, timed)
        if not noise.contended(timed):
            break
    if best is None:
        raise ValueError(f"bench.reference sizes: SIZES_ATTEMPTS is {SIZES_ATTEMPTS}; it must be >= 1")
    return best


def measure_sizes(path: Path, min_run_time: float, rounds: int, ops: list[str] | None = None) -> dict[str, Any]:
    """Thread CPU time (one thread) of native and every other composite of each op of ``ops`` (default: every op of
    bench/size_grids.py) over its grid, in interleaved rounds per point; a point measured under contention
    (``noise.contended``) is re-measured, then kept with its share of CPU time. The grids of other ops already in
    ``path`` are kept (with the machine they were measured on)."""
    from itertools import product

    from registry.core.cost import NATIVE_BATCH_RULES
    from registry.core.registration import COMPOSITES, load
    from registry.core.routing import ROUTER
    from registry.profiling import noise

    load()
    torch.set_num_threads(1)
    wanted = [*GRIDS, *OPINFO_GRID_OPS] if ops is None else ops
    unknown = [op for op in wanted if op not in GRIDS and op not in OPINFO_GRID_OPS]
    if unknown:
        raise ValueError(f"bench.reference sizes: no size grid for {', '.join(unknown)}; the grids are "
                         f"{', '.join([*GRIDS, *OPINFO_GRID_OPS])} (bench/size_grids.py)")
    machine = machine_name()
    previous = json.loads(path.read_text()) if path.exists() else {}
    kept = [dict(g, machine=g.get("machine", previous.get("machine", ""))) for g in previous.get("grids", [])
            if g["op"] not in wanted]
    grids = []
    for op in wanted:
        grid = grid_of(op)
        composites = list(COMPOSITES[op])
        if op in SIZES_RULES:
            if ROUTER.routing_backend() == "cpp":
                composites.append(NATIVE_BATCH_RULES)  # PyTorch's kernel pinned: its batch folded by the C++ rule
            else:
                print("bench.reference sizes: the C++ routing backend is not active, so native is timed in vmap's "
                      f"loop only (no {NATIVE_BATCH_RULES}); build it with `multicomposite build-kernels`",
                      file=sys.stderr)
        axes = list(grid.axes)
        for workload, stack in SIZES_WORKLOADS.items():
            if workload not in grid.workloads:
                continue
            for fixed in grid.variants:
                points = []
                for values in product(*grid.axes.values()):
                    at = dict(zip(axes, values, strict=True))
                    if grid.too_large(at):
                        continue
                    share, timed = _measure_point(_size_runners(grid, at, dict(fixed), workload, composites),
                                                  rounds, min_run_time)
                    ranked = noise.relative(timed)
                    point: dict[str, Any] = {"at": at,
                                             "times_us": {n: round(t.median_us, 2) for n, t in ranked.items()}}
                    if noise.contended(timed):
                        # Kept, in thread CPU time and per-round ratios (what descheduling moves least), with its
                        # share.
                        point["ran"] = round(share, 2)
                    points.append(point)
                    print(f"{op} {workload:10s} {dict(fixed)} {at} " + " ".join(
                        f"{n} {t.median_us:.0f}" for n, t in ranked.items()), flush=True)
                grids.append({"op": op, "stack": list(stack), "workload": workload, "fixed": dict(fixed),
                              "axes": grid.axes, "machine": machine, "points": points})
    document = {"machine": machine, "measured_by": "python -m bench.reference sizes",
                "clock": "thread CPU time, one thread; median per-round ratio to the fastest, interleaved rounds",
                "grids": kept + grids}
    path.write_text(json.dumps(document, indent=1) + "\n")
    return document


def _case(op: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    self = torch.randn(BATCH, NUMEL, generator=g)
    mask = torch.rand(BATCH, NUMEL, generator=g) > 0.5
    index = torch.randperm(NUMEL, generator=g)[:NUMEL // 8]
    if op == "masked_scatter":
        return (lambda s, m, src: torch.masked_scatter(s, m, src)), (self, mask, torch.randn(BATCH, NUMEL))
    if op == "masked_fill":
        return (lambda s, m, v: torch.masked_fill(s, m, v)), (self, mask, torch.randn(BATCH))
    return (lambda s, v: torch.index_fill(s, 0, index, v)), (self, torch.randn(BATCH))


def check(rounds: int, min_run_time: float, cpu_time: bool = False) -> list[dict[str, Any]]:
    """Auto's time over the fastest valid composite's, per checked op, on an empty store; ``cpu_time``: one
    thread, timed in the calling thread's CPU time (time spent descheduled by other processes does not count)."""
    clock = time.thread_time if cpu_time else time.perf_counter
    if cpu_time:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{folder}/empty.db"
        import registry
        from registry.core import selector
        from registry.profiling import noise

        selector.clear_cache()
        results = []
        for op in CHECKED:
            fn, tensors = _case(op)

            def per_sample_grad(*t: torch.Tensor, fn: Any = fn) -> Any:
                return func.grad(lambda s, *rest: (fn(s, *rest) ** 2).sum())(*t)

            run = func.vmap(per_sample_grad)

            def routed(pins: dict[str, str] | None = None, run: Any = run, tensors: Any = tensors) -> Any:
                def call() -> Any:
                    with registry.use(pins=pins):
                        return run(*tensors)
                return call

            batched = tuple(name for name in registry.OPS[op].tensor_args if name in ("self", "mask", "value"))
            decision = registry.select(op, stack="vmap,grad", batched=batched, dtype="float32", numel=NUMEL)
            runners = {"auto": routed()}
            for alternative in (decision.composite, *(v.composite for v in decision.alternatives if v.ok)):
                runners[alternative] = routed({op: alternative})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timed = noise.interleaved(runners, rounds=rounds, min_run_time=min_run_time, clock=clock)
            # The fastest pinned composite by its median per-round ratio to the others (noise.relative), then auto
            # over it per round: a ratio within a round is what a load on the machine cannot bias.
            pinned = noise.relative({n: t for n, t in timed.items() if n != "auto"})
            fastest = min(pinned, key=lambda n: pinned[n].median_us)
            ratios = [a / f for a, f in zip(timed["auto"].rounds_us, timed[fastest].rounds_us, strict=True)]
            results.append({"op": op, "auto_choice": decision.composite, "fastest": fastest,
                            "auto_is_fastest": decision.composite == fastest,
                            "medians_ms": {n: round(t.median_us / 1e3, 2) for n, t in timed.items()},
                            "auto_over_fastest": round(statistics.median(ratios), 3), "reason": decision.reason})
        os.environ.pop("MULTICOMPOSITE_DB")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference", description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    measuring = actions.add_parser("measure", help="profile the seed ops and write the reference file")
    measuring.add_argument("--out", type=Path, default=None, help="default: registry/core/reference_profiles.json")
    measuring.add_argument("--min-run-time", type=float, default=0.5, help="seconds per context (default 0.5)")
    measuring.add_argument("--workload", action="append", choices=WORKLOADS,
                           help=f"repeatable (default: {', '.join(DEFAULT_WORKLOADS)})")
    sizing = actions.add_parser("sizes", help="measure the reference costs by size (reference_costs.json)")
    sizing.add_argument("--out", type=Path, default=None, help="default: registry/core/reference_costs.json")
    sizing.add_argument("--min-run-time", type=float, default=0.1, help="thread CPU seconds per point and composite")
    sizing.add_argument("--rounds", type=int, default=5)
    sizing.add_argument("--op", action="append", dest="ops",
                        help="repeatable: measure only these ops' grids and keep the others in the file "
                             "(default: every op of bench/size_grids.py)")
    checking = actions.add_parser("check", help="auto on an empty store against the fastest valid composite")
    checking.add_argument("--rounds", type=int, default=7)
    checking.add_argument("--min-run-time", type=float, default=1.0)
    checking.add_argument("--cpu-time", action="store_true",
                          help="one thread, timed in thread CPU time (time spent descheduled does not count)")
    args = parser.parse_args(argv)
    if args.action == "measure":
        from registry.core import reference

        document = measure(args.out or reference.PATH, args.min_run_time, args.workload or list(DEFAULT_WORKLOADS))
        print(f"{len(document['contexts'])} contexts measured on {document['machine']}")
        return 0
    if args.action == "sizes":
        from registry.core import cost

        try:
            document = measure_sizes(args.out or cost.PATH, args.min_run_time, args.rounds, args.ops)
        except ValueError as error:
            parser.error(str(error))
        measured = [g for g in document["grids"] if args.ops is None or g["op"] in args.ops]
        print(f"{sum(len(g['points']) for g in measured)} points measured on {document['machine']}")
        return 0
    results = check(args.rounds, args.min_run_time, args.cpu_time)
    for result in results:
        print(f"{result['op']:16s} auto -> {result['auto_choice']:11s} fastest {result['fastest']:11s} "
              f"auto/fastest {result['auto_over_fastest']:.3f}  medians ms {result['medians_ms']}")
    worst = max(r["auto_over_fastest"] for r in results)
    print(f"worst auto/fastest {worst:.3f} (target <= {TARGET:.2f})")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
