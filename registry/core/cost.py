"""Selection by cost at the call's sizes: native or a composite, where native is correct and only loops.

vmap's per-sample loop over a fused kernel is not always slower than a composite: looping over four large fused
calls can beat one folded call that pays for its packing, unpacking and Python frames. So where PyTorch's own op is
correct under the stack and only loops (its rule says ``slow``), an op that declares a *size signature*
(``define_op(..., sizes=fn)``: the sizes its cost depends on, from the call's Context) is decided by the measured
cost of each valid composite against native at the call's **size bucket** (each size rounded down to a power of
two), never by "native loops" alone:

1. a local profile of the op (``multicomposite profile``) where it timed native and a valid composite, except where
   the C++ batching rule would serve native (the profile timed native outside ``use()``, in vmap's loop);
2. else the reference costs shipped with the package (``reference_costs.json``, next to this module, written by
   ``python -m bench.reference sizes``): per stack and per value of the signature's categorical sizes (a mask or
   not, the sample's rank), native's and each composite's thread CPU time (one thread) on a grid of sizes, native's
   twice: in vmap's loop (``native``) and with this package's C++ batching rule (``native_batch_rules``), the one
   weighed where the call would run with that rule (``Context.native_batch_rules``: the C++ routing backend, a
   policy other than native), the loop elsewhere. Between
   grid points the log of each composite's time over native's is interpolated linearly in the log2 of every size
   (multilinear across the sizes); outside the grid the nearest edge holds. A grid point that was too large to
   measure takes its nearest measured neighbour's ratio;
3. with nothing known at that bucket, native runs: it is correct, and it is what the call does without use().

An op may declare the generic signature ``batch_and_numel`` (the samples, and the first tensor's elements per
sample) with reference costs measured on OpInfo's own samples (bench/size_grids.py's ``opinfo_grid``): such costs
decide only within what was measured (up to the measured elements per sample, ``MEASURED_ONLY_AXES``); above it, and
where no grid was measured, the rules decide, as for an op without a signature.

A composite replaces native only where it is faster by more than ``ratios.MIN_NOISE``: a tie keeps PyTorch's op.
The decision's reason names the ratio and the bucket. Ops without a size signature are decided as before.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import torch

from registry.core import evidence
from registry.core.context import Context
from registry.core.ops import schema_params
from registry.core.ratios import MIN_NOISE, ratio_text

PATH = Path(__file__).with_name("reference_costs.json")
NATIVE = "native"
# PyTorch's own op timed with the C++ batching rules of registry.core.batch_rules (bench.reference sizes)
NATIVE_BATCH_RULES = "native_batch_rules"
BASELINES = (NATIVE, NATIVE_BATCH_RULES)

Sizes = Mapping[str, "int | bool | str"]
SizeSignature = Callable[[Context], "Sizes | None"]


def batch_and_numel(ctx: Context) -> Sizes | None:
    """The generic size signature: the samples, the first tensor's elements per sample and which arguments are
    batched (its cost grids, measured on OpInfo's samples, decide only within the measured elements and batching:
    ``Signatures.measured_only``)."""
    if not ctx.shapes:
        return None
    return {"batch": ctx.batch_size, "numel": math.prod(ctx.shapes[0]), "batched": ",".join(ctx.batched)}


# The axes of a generic grid (batch_and_numel's) beyond whose measured values its costs do not reach: measured at
# OpInfo's sample sizes, they say nothing of a sample many times larger. Along the batch the nearest edge holds.
MEASURED_ONLY_AXES = ("numel",)


class CostError(ValueError):
    """The shipped reference costs cannot be read, or a size signature is declared twice: said with what to do."""


Bucket = tuple[tuple[str, "int | bool | str"], ...]


@dataclass
class Signatures:
    """op name -> its size signature (``define_op(..., sizes=fn)``): one per op table (``OpTable.signatures``)."""

    by_op: dict[str, SizeSignature] = field(default_factory=dict)

    def declare(self, op: str, signature: SizeSignature) -> None:
        if op in self.by_op:
            raise CostError(f"define_op({op}): a size signature is already declared for {op}")
        self.by_op[op] = signature

    def measured_only(self, op: str) -> bool:
        """Whether ``op``'s costs decide only within their measured sizes (the generic ``batch_and_numel``)."""
        return self.by_op.get(op) is batch_and_numel

    def bucket(self, op: str, ctx: Context) -> Bucket | None:
        """The size bucket of ``op`` in ``ctx`` by its signature, or None (no signature, or it does not apply)."""
        signature = self.by_op.get(op)
        if signature is None:
            return None
        sizes = signature(ctx)
        if sizes is None:
            return None
        return tuple((name, _bucketed(value)) for name, value in sizes.items())


def _bucketed(value: int | bool | str) -> int | bool | str:
    """A size rounded down to a power of two (1 for 0 and 1); booleans and names as they are."""
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    return 1 << max(value.bit_length() - 1, 0)


# --- the shipped reference costs: grids of sizes, interpolated ------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """One op's reference costs under one stack at one value of its categorical sizes."""

    stack: tuple[str, ...]
    fixed: tuple[tuple[str, bool | str | int], ...]  # categorical sizes, matched exactly
    axes: tuple[tuple[str, tuple[int, ...]], ...]  # numeric sizes, each with its measured values (ascending)
    points: dict[tuple[int, ...], dict[str, float]]  # axis values -> composite -> microseconds per call
    machine: str = ""  # what it was measured on, where the file names it per grid

    def ratios(self, at: Mapping[str, int], baseline: str = NATIVE) -> dict[str, float]:
        """Each composite's time over native's (``baseline``: native's loop, or native with the C++ batching rules;
        native's loop at a point that did not time the rules) at ``at``: log-ratios interpolated multilinearly in
        log2 sizes."""
        corners: list[list[tuple[int, float]]] = []
        for name, values in self.axes:
            x = math.log2(max(at[name], 1))
            logs = [math.log2(v) for v in values]
            if x <= logs[0] or len(values) == 1:
                corners.append([(values[0], 1.0)])
            elif x >= logs[-1]:
                corners.append([(values[-1], 1.0)])
            else:
                upper = next(i for i, v in enumerate(logs) if v >= x)
                weight = (x - logs[upper - 1]) / (logs[upper] - logs[upper - 1])
                corners.append([(values[upper - 1], 1.0 - weight), (values[upper], weight)])
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        for combination in product(*corners):
            weight = math.prod(w for _, w in combination)
            if weight == 0.0:
                continue
            times = self._nearest(tuple(v for v, _ in combination))
            native = times.get(baseline) or times.get(NATIVE)
            if not native:
                continue
            for composite, us in times.items():
                if composite not in BASELINES and us > 0:
                    totals[composite] = totals.get(composite, 0.0) + weight * math.log(us / native)
                    weights[composite] = weights.get(composite, 0.0) + weight
        return {c: math.exp(totals[c] / weights[c]) for c in totals if weights[c] > 0}

    def covers(self, at: Mapping[str, int]) -> bool:
        """Whether ``at`` is within the measured values of the grid's ``MEASURED_ONLY_AXES``."""
        return all(at[name] <= values[-1] for name, values in self.axes if name in MEASURED_ONLY_AXES)

    def timed(self, name: str) -> bool:
        """Whether any point of the grid timed ``name`` (a composite, or one of native's BASELINES)."""
        return any(name in times for times in self.points.values())

    def _nearest(self, point: tuple[int, ...]) -> dict[str, float]:
        """The times at a grid point, or at the nearest measured one (in log2 sizes) where it was not measured."""
        found = self.points.get(point)
        if found is not None:
            return found
        def distance(other: tuple[int, ...]) -> float:
            return sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(point, other, strict=True))
        return self.points[min(self.points, key=distance)] if self.points else {}


@dataclass(frozen=True)
class ReferenceCosts:
    machine: str
    grids: dict[str, list[Grid]]  # op -> its grids

    def grid(self, op: str, stack: tuple[str, ...], sizes: Mapping[str, Any]) -> Grid | None:
        """The grid of ``op`` under ``stack`` whose categorical sizes are those in ``sizes``."""
        for grid in self.grids.get(op, ()):
            if grid.stack == stack and all(k in sizes and sizes[k] == v and type(sizes[k]) is type(v)
                                           for k, v in grid.fixed):
                return grid
        return None


@functools.cache
def _load(path: Path) -> ReferenceCosts:
    if not path.exists():
        return ReferenceCosts("", {})
    try:
        document = json.loads(path.read_text())
        grids: dict[str, list[Grid]] = {}
        for entry in document["grids"]:
            axes = tuple((str(name), tuple(int(v) for v in values)) for name, values in entry["axes"].items())
            points = {tuple(int(point["at"][name]) for name, _ in axes):
                      {str(k): float(v) for k, v in point["times_us"].items()} for point in entry["points"]}
            grids.setdefault(str(entry["op"]), []).append(
                Grid(stack=tuple(entry["stack"]), fixed=tuple(sorted(entry["fixed"].items())), axes=axes,
                     points=points, machine=str(entry.get("machine", document["machine"]))))
        return ReferenceCosts(machine=str(document["machine"]), grids=grids)
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as error:
        raise CostError(f"{path}: unreadable reference costs ({type(error).__name__}: {error}); regenerate them "
                        "with `python -m bench.reference sizes`") from None


_lock = threading.Lock()


def reference_costs(path: Path | None = None) -> ReferenceCosts:
    with _lock:
        return _load(path or PATH)


# --- the choice ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costed:
    """A choice by cost: the composite (native's name where native runs), why, and native's time over its."""

    composite: str
    reason: str
    speedup: float | None


def _where(ctx: Context, sizes: tuple[tuple[str, int | bool | str], ...]) -> str:
    stack = ",".join(ctx.stack) or "no transform"
    said = ", ".join(name if value is True else f"no {name}" if value is False else f"{name} {value}"
                     for name, value in sizes)
    return f"{stack} at {said}"


def choose(op: str, ctx: Context, judged: Iterable[tuple[Any, Any]], policy: str, sizes: Bucket | None,
           source: evidence.EvidenceSource, tensor_args: tuple[str, ...],
           costs: ReferenceCosts | None = None, *, measured_only: bool = False) -> Costed | None:
    """The choice between native and the valid composites by their cost at ``ctx``'s size bucket (``sizes``: the
    op's ``Signatures.bucket``), where native is correct and only loops (its problem is ``slow``) and ``op`` has a
    size signature; None leaves the choice to the rules and profiles as before. ``judged``: (composite, problem or
    None) of every composite of ``op``; ``source``: the registry's evidence; ``tensor_args``: the op's tensor
    parameters; ``measured_only``: the costs decide only within the sizes they measured (``Signatures``), else
    None."""
    if policy not in ("auto", "fastest"):
        return None
    if sizes is None:
        return None
    judged = list(judged)
    native = next((c for c, p in judged if c.kind == "native"), None)
    if native is None:
        return None
    problem = dict((c.name, p) for c, p in judged)[native.name]
    if problem is None or problem.status != "slow":
        return None  # native is valid (it runs anyway) or wrong here (it must not run)
    measured_native, _ = source.evidence(op, native.name, ctx, tensor_args)
    if measured_native is not None and measured_native.status != "slow":
        return None
    valid = [c for c, p in judged if p is None]
    where = _where(ctx, sizes)
    runs = "vmap's per-sample loop"  # how native runs, as the costs weighed it
    against = "native"
    table = costs or reference_costs()
    named = dict(sizes)
    grid = table.grid(op, ctx.stack, named)
    if grid is not None and not all(isinstance(named.get(name), int) for name, _ in grid.axes):
        grid = None
    if grid is not None and measured_only and not grid.covers(named):
        grid = None
    # NOTE: where the C++ batching rule folds the batch, native is no loop: weighing the loop's time there picked
    # the folded composite at sizes where PyTorch's kernel with the rule is faster (1.3-1.5x at batch 16-64, length
    # 32). A local profile times native outside use(), in the loop, so there only the reference costs, which time
    # native with the rule too, decide.
    with_rules = ctx.native_batch_rules and grid is not None and grid.timed(NATIVE_BATCH_RULES)
    ratios, said = ({}, "") if with_rules else _local(source, op, ctx, native.name, [c.name for c in valid])
    if not ratios and grid is not None:
        if with_rules:
            runs, against = "its batch folded by this package's C++ batching rule", "native with that rule"
        ratios = {c: r for c, r in grid.ratios(named, NATIVE_BATCH_RULES if with_rules else NATIVE).items()
                  if c in {v.name for v in valid}}
        said = (f"the reference costs shipped with the package, interpolated between measured sizes; thread CPU "
                f"time, one thread, measured on {grid.machine or table.machine}")
    if not ratios:
        if measured_only:
            return None  # nothing measured at these sizes: the rules decide, as without a signature
        return Costed(native.name, f"PyTorch's own {op} runs under {where}: it is correct here (vmap's per-sample "
                                   "loop), and no cost of a composite is known at this size", None)
    best = min(ratios, key=ratios.__getitem__)
    ratio = ratios[best]
    if ratio < 1 / (1 + MIN_NOISE):
        return Costed(best, f"{best} is {ratio_text(ratio, against)} under {where} ({said})", 1 / ratio)
    return Costed(native.name, f"PyTorch's own {op} runs under {where}: correct here ({runs}), and "
                               f"{best} is {ratio_text(ratio, against)} at this size ({said})", 1.0)


def _local(source: evidence.EvidenceSource, op: str, ctx: Context, native: str, valid: list[str],
           ) -> tuple[dict[str, float], str]:
    """Each valid composite's time over native's in a local profile (``multicomposite profile``), where it timed
    native and at least one of them."""
    timings = source.timings(op, ctx, [native, *valid])
    if native not in timings or not any(name in timings for name in valid):
        return {}, ""
    base = timings[native]
    ratios = {name: timings[name].score_us / base.score_us for name in valid if name in timings}
    batches = ",".join(str(b) for b in base.batch_sizes)
    return ratios, f"profiled on this machine at {base.bucket} elements, batch {batches}"


# --- derivative ops: folded where the op itself is ------------------------------------------------------------------


def derivative_arguments(op: str, overload: str, signatures: Signatures, tensor_args: tuple[str, ...],
                         ) -> Callable[[tuple[Any, ...], Mapping[str, Any]], dict[str, torch.Tensor]] | None:
    """For a derivative op of ``op`` (``register_derivative``): what to decide ``op`` on when the derivative is
    reached under vmap, its tensors named as ``op``'s tensor parameters (the router then runs PyTorch's own kernel
    where ``op`` itself, at these sizes, runs natively); None where ``op`` has no size signature (its derivatives are
    always replaced under vmap). ``signatures``: the op table's; ``tensor_args``: ``op``'s tensor parameters."""
    if op not in signatures.by_op:
        return None
    name, _, overload_name = overload.partition(".")
    params = tuple(param for param, _ in schema_params(name, overload_name))
    wanted = tensor_args

    def arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        values = dict(zip(params, args, strict=False))
        values.update(kwargs)
        return {n: values[n] for n in wanted if isinstance(values.get(n), torch.Tensor)}

    return arguments
