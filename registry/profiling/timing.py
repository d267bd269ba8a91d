"""``profile()``: time every composite side by side with native in each context; the store keeps the timings and
policy ``auto`` ranks the valid composites by them.

Each workload batches the op's tensors over ``batch_size`` samples of ``numel`` elements and runs it under a
user-level transform: ``vmap``; ``grad`` (of a loss over the whole batch, the op vmapped, so the op sees
``grad, vmap``); ``vmap(grad)`` (per-sample gradients); per-sample ``jacrev``, ``jacfwd`` and ``hessian`` (under an
outer vmap, at 16 elements a sample since a Jacobian is numel squared). The stack stored is the one the op's forward
sees, which is what the selector looks up at run time. Each composite's result is first compared with the
functional composite's (which the verified matrix shows ok in every stack): one that raises or differs is stored
invalid and never timed.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from registry.core import context
from registry.core.messages import described
from registry.core.model import Composite
from registry.core.ops import ORIGINAL
from registry.core.registration import COMPOSITES, load
from registry.core.routing import use
from registry.core.sources import source_hash
from registry.core.stacks import parse_stack
from registry.harness.comparison import compare
from registry.harness.interpreter import Layout, transformed
from registry.harness.samples import SAMPLES
from registry.profiling import noise
from registry.store.records import ProfileEntry

WORKLOADS = ("vmap", "grad", "vmap(grad)", "jacrev", "jacfwd", "hessian")
JACOBIAN_NUMEL = 16  # per sample: a Jacobian has numel**2 elements


def bucket(numel: int | None) -> int:
    """The power of two at or above ``numel``: the size key of a profile (as in Inductor's and Triton's caches)."""
    return 1 << max(int(numel or 1) - 1, 0).bit_length()


@dataclass(frozen=True)
class WorkloadCase:
    """One profiling workload's op and inputs: ``fn`` maps over dim 0 of ``tensors``."""

    fn: Callable[..., torch.Tensor]  # the op on the batchable tensors, per sample
    tensors: tuple[torch.Tensor, ...]  # batched along dim 0


# The op's tensor arguments (schema names) each seed workload batches: what a profile of it says something about
# (registry/core/reference.py applies a shipped profile only where the same arguments are batched). index_add's and
# index_copy's index is one the samples share.
WORKLOAD_BATCHED: dict[str, tuple[str, ...]] = {
    "index_add": ("self", "source"), "index_copy": ("self", "source"), "index_fill": ("self", "value"),
    "masked_fill": ("self", "mask", "value"), "masked_scatter": ("self", "mask", "source"),
    "contiguous": ("self",), "to": ("self",),
}


def workload_case(op: str, call: Callable[..., torch.Tensor], numel: int, batch: int, dtype: torch.dtype,
                  device: str) -> WorkloadCase:
    """The op as ``call`` (a composite, or PyTorch's own) on ``batch`` samples of ``numel`` elements."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    def mask(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=g) > 0.5).to(device)

    k = max(numel // 8, 1)
    index = torch.randperm(numel, generator=g)[:k].to(device)
    if op in ("index_add", "index_copy"):
        return WorkloadCase(lambda s, src: call(s, 0, index, src), (rand(batch, numel), rand(batch, k)))
    if op == "index_fill":
        return WorkloadCase(lambda s, v: call(s, 0, index, v), (rand(batch, numel), rand(batch)))
    if op == "masked_fill":
        return WorkloadCase(lambda s, m, v: call(s, m, v), (rand(batch, numel), mask(batch, numel), rand(batch)))
    if op == "masked_scatter":
        return WorkloadCase(lambda s, m, src: call(s, m, src),
                            (rand(batch, numel), mask(batch, numel), rand(batch, numel)))
    if op == "contiguous":
        width = max(math.isqrt(numel), 1)
        return WorkloadCase(lambda s: call(s.mT), (rand(batch, numel // width, width),))
    if op == "to":
        other = torch.float64 if dtype != torch.float64 else torch.float32
        return WorkloadCase(lambda s: call(s, dtype=other), (rand(batch, numel),))
    raise ValueError(f"profile: no workload for op {op!r}")


# Each workload as the interpreter's layers (registry.harness.interpreter), every tensor batched along dim 0.
PROGRAMS: dict[str, tuple[str, ...]] = {
    "vmap": ("vmap",),
    "grad": ("grad", "vmap"),  # the gradient of a loss over the whole batch, the op mapped over the samples
    "vmap(grad)": ("vmap", "grad"),
    "jacrev": ("vmap", "jacrev"),
    "jacfwd": ("vmap", "jacfwd"),
    "hessian": ("vmap", "hessian"),
}


def _square_sum(y: torch.Tensor) -> torch.Tensor:
    return (y * y).sum()


def workload_runner(workload: str, case: WorkloadCase) -> Callable[[], Any]:
    if workload not in PROGRAMS:
        raise ValueError(f"unknown workload {workload!r}; workloads are {', '.join(WORKLOADS)}")
    layers = PROGRAMS[workload]
    layout = Layout(in_dims=((0,) * len(case.tensors),) * layers.count("vmap"), wrt=0, loss=_square_sum)
    run = transformed(layers, case.fn, layout)
    return lambda: run(*case.tensors)


def seen_by_op(workload: str, case: WorkloadCase) -> tuple[tuple[str, ...], int]:
    """The stack and element count the op sees in ``workload``, captured by running it once."""
    seen: list[tuple[tuple[str, ...], int]] = []

    def spy(*tensors: torch.Tensor) -> torch.Tensor:
        if not seen:
            seen.append((context.current_stack(*tensors), tensors[0].numel()))
        return case.fn(*tensors)

    workload_runner(workload, WorkloadCase(spy, case.tensors))()
    return seen[0]


def _close(a: Any, b: Any) -> bool:
    return compare(a, b, tolerance="profile") is None


def _earlier_profiles() -> list[ProfileEntry]:
    """The default store's fresh profiles (none without a store): native's earlier timings to compare with."""
    from registry.store import evidence

    return list(evidence.stored_profiles())


def _native_key(op: str, workload: str, dtype: str, device: str, numel_bucket: int, batch: int) -> tuple:
    return (op, workload, dtype, device, numel_bucket, batch)


# Workloads of ops whose cases come from OpInfo (registry.harness.opinfo): the survey's batched stacks, on OpInfo's
# first sample (its own size: ``numels`` does not apply), batched over ``batch`` varied copies.
OPINFO_WORKLOADS = ("vmap", "vmap(grad)")
_PROFILE_CANDIDATES = 8  # OpInfo samples looked at for the first one vmap does not call random


def _random_under_vmap(op: str, workload: str, case: Any) -> bool:
    """Whether one of ``op``'s composites, pinned, raises vmap's randomness error on ``case``."""
    from registry.harness import case_stacks

    if workload != "vmap":
        try:
            case.weights()  # the loss's weights are drawn on first use: here, outside vmap
        except Exception:  # the op fails on this sample outside any transform: the profile's to say, not random
            return False
    for name in COMPOSITES[op]:
        try:
            with warnings.catch_warnings(), use(pins={op: name}):
                warnings.simplefilter("ignore")
                case_stacks.run_stack(workload, case)
        except RuntimeError as error:
            if case_stacks.RANDOM_UNDER_VMAP in str(error):
                return True
        except Exception:  # any other failure is the profile's to record, not a reason to skip a sample
            continue
    return False


class _NoCase(Exception):  # noqa: N818 -- a reason, not a failure
    """OpInfo has no sample of this op that the workload can run."""


Context = tuple[tuple[str, ...], int, Callable[[Composite], Callable[[], Any]], Any]


def _seed_context(op: str, workload: str, numel: int, batch: int, dtype: torch.dtype, device: str) -> Context:
    """(stack the op sees, its element count, composite -> runner, reference result) from the hand-made cases."""
    size = JACOBIAN_NUMEL if workload in ("jacrev", "jacfwd", "hessian") else numel
    functional = COMPOSITES[op]["functional"].fn
    # The reference is the functional composite, which the verified matrix shows ok in every stack.
    reference_case = workload_case(op, functional, size, batch, dtype, device)
    stack, seen_numel = seen_by_op(workload, reference_case)
    reference = workload_runner(workload, reference_case)()

    def calls(composite: Composite) -> Callable[[], Any]:
        call = getattr(ORIGINAL.Tensor, op) if composite.kind == "native" else composite.fn
        return workload_runner(workload, workload_case(op, call, size, batch, dtype, device))

    return stack, seen_numel, calls, reference


def opinfo_sample(op: str, workload: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(op_db entry, sample) a workload of ``op`` is profiled on: OpInfo's first sample that vmap does not call
    random. A random one (rrelu in training; OpInfo seeds it, so only vmap's randomness check tells) cannot be
    compared with a per-sample loop under vmap (rrelu's eval sample is timed instead)."""
    from registry.harness import opinfo
    from registry.harness import opinfo_cases as cases

    entry = opinfo.entries(op)[0]
    samples = cases.pick_samples(entry, dtype, _PROFILE_CANDIDATES)
    if not samples:
        raise _NoCase(f"OpInfo has no {dtype} sample of {cases.entry_id(entry)}")
    sample = next((s for s in samples
                   if not _random_under_vmap(op, workload, cases.SurveyCase(entry, s, "input", 2))), None)
    if sample is None:
        raise _NoCase(f"vmap calls its first {len(samples)} samples random (randomness='error')")
    return entry, sample


def _opinfo_context(op: str, workload: str, batch: int, dtype: torch.dtype,
                    chosen: dict[tuple[str, str, torch.dtype], tuple[Any, Any] | _NoCase]) -> Context:
    """The same from OpInfo's sample (``opinfo_sample``, found once per op, workload and dtype in ``chosen``)
    through the survey's interpreter: native outside ``use()``, every other composite pinned inside it (so the
    router's own cost is in its time); the reference is the per-sample loop of native outside any transform."""
    from registry.harness import case_stacks
    from registry.harness import opinfo_cases as cases

    key = (op, workload, dtype)
    if key not in chosen:
        try:
            chosen[key] = opinfo_sample(op, workload, dtype)
        except _NoCase as why:
            chosen[key] = why
    found = chosen[key]
    if isinstance(found, _NoCase):
        raise found
    entry, sample = found
    case = cases.SurveyCase(entry, sample, "input", batch)
    if workload == "vmap(grad)" and not case.diff:
        raise _NoCase("nothing to differentiate in its first sample")
    why_not = cases.static_reason(case, workload, dtype)  # no float output, random under vmap, ...
    if why_not is not None:
        raise _NoCase(f"the survey cannot check it: {why_not}")
    try:
        if workload == "vmap(grad)" and not case.differentiable_outputs(case.call(case.per_sample[0])):
            raise _NoCase("no real floating output to differentiate (complex or integer outputs only)")
        reference = case_stacks.reference(workload, case_stacks.Reference(case))
    except _NoCase:
        raise
    except Exception as error:  # the op refuses the sample (one_hot of floats), or an integer output (hash_tensor)
        raise _NoCase(f"no reference outside the transform ({described(error)})") from None

    def calls(composite: Composite) -> Callable[[], Any]:
        if composite.kind == "native":
            return lambda: case_stacks.run_stack(workload, case)

        def pinned() -> Any:
            with use(pins={op: composite.name}):
                return case_stacks.run_stack(workload, case)

        return pinned

    numel = case.per_sample[0][0].numel() if case.per_sample[0] else 0
    return parse_stack(workload), numel, calls, reference


def profile(
    ops: Iterable[str] | None = None,
    workloads: Sequence[str] | None = None,
    numels: Sequence[int] = (1024,),
    batch_sizes: Sequence[int] = (1, 32, 256),
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    device: str = "cpu",
    min_run_time: float = 0.1,
    progress: Callable[[int, int, str], None] | None = None,
    *,
    rounds: int = noise.ROUNDS,
    retries: int = 2,
    earlier: Sequence[ProfileEntry] | None = None,
    refused: list[str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    spread_limit: float = noise.SPREAD_LIMIT,
) -> list[ProfileEntry]:
    """Time every composite of each op, side by side, in each workload, size, batch and dtype.

    Composites are called directly (native through PyTorch's own entry point), so native is timed where it falls
    back to vmap's loop too: that is the baseline of every speedup. A composite that raises or disagrees with the
    reference is stored invalid, untimed.

    The valid composites of a context are timed in ``rounds`` interleaved rounds (``noise.interleaved``); the two
    fastest get as many rounds again, side by side, before they are ranked. They are ranked by their per-round ratios
    to the fastest (``noise.relative``: what is stored is the fastest one's median times each one's median ratio,
    with the ratio's spread), so a load on the machine that every composite of a round shares moves no decision. A
    context whose ranking is unstable (``noise.unstable``: the two fastest told apart by the median ratio, yet the
    leader faster in fewer than ``noise.WIN_SHARE`` of their rounds), or on whose composites the load fell unevenly
    (``noise.uneven``: the share of its time each one ran differs), is re-measured up to ``retries`` times, and one
    whose native time is ``noise.NATIVE_DRIFT_LIMIT`` times off its ``earlier`` profile (default: the store's) once
    (its entries say so in ``detail``); one still disturbed after that is not returned at all, so it is never stored,
    and ``refused`` (if given, else a RuntimeWarning) gets a line saying why and what to change.
    ``spread_limit=math.inf`` keeps every timing (tests of what is stored).
    """
    load()
    op_names = list(ops) if ops is not None else list(COMPOSITES)
    workload_list = list(workloads) if workloads is not None else list(WORKLOADS)
    unknown = [w for w in workload_list if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; workloads are {', '.join(WORKLOADS)}")
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    earlier_native = {
        _native_key(p.op, p.workload, p.dtype, p.device, p.numel_bucket, p.batch_size): p.median_us
        for p in (earlier if earlier is not None else _earlier_profiles())
        if p.kind == "native" and p.valid and p.median_us
    }
    plan = [(op, w, n, b, d) for op in op_names for w in workload_list for n in numels for b in batch_sizes
            for d in dtypes if op in SAMPLES or (w in OPINFO_WORKLOADS and n == numels[0])]
    total = sum(len(COMPOSITES[op]) for op, *_ in plan)
    done = 0
    entries: list[ProfileEntry] = []
    chosen: dict[tuple[str, str, torch.dtype], tuple[Any, Any] | _NoCase] = {}  # per op, workload, dtype
    for op, workload, numel, batch, dtype in plan:
        if op in SAMPLES:
            stack, seen_numel, calls, reference = _seed_context(op, workload, numel, batch, dtype, device)
        else:
            try:
                stack, seen_numel, calls, reference = _opinfo_context(op, workload, batch, dtype, chosen)
            except _NoCase as why:
                if refused is not None:
                    refused.append(f"{op} {workload} b={batch}: not profiled, {why}")
                done += len(COMPOSITES[op])
                continue
        context: list[ProfileEntry] = []
        runners: dict[str, Callable[[], Any]] = {}
        commons: dict[str, dict[str, Any]] = {}
        native_name = None
        for composite in COMPOSITES[op].values():
            done += 1
            run = calls(composite)
            common = dict(op=op, composite=composite.name, kind=composite.kind, stack=stack, workload=workload,
                          dtype=str(dtype).removeprefix("torch."), device=device.split(":")[0],
                          device_name=device_name, numel_bucket=bucket(seen_numel), batch_size=batch,
                          source_hash=source_hash(composite), torch_version=torch.__version__)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # native's fallback loop is timed, not reported here
                    if not _close(run(), reference):
                        raise ValueError(f"{composite.name} differs from the reference in {workload}")
                runners[composite.name], commons[composite.name] = _quiet(run), common
                native_name = composite.name if composite.kind == "native" else native_name
            except Exception as error:  # a composite that fails here is data: stored invalid, never timed
                context.append(ProfileEntry(**common, valid=False, detail=described(error),
                                            median_us=None, iqr_us=None, runs=0, peak_memory=None))
            if progress is not None:
                progress(done, total, f"{op}/{composite.name} {workload} n={seen_numel} b={batch}")
        label = f"{op} {workload} n={seen_numel} b={batch} {str(dtype).removeprefix('torch.')}"
        earlier_us = earlier_native.get(_native_key(op, workload, str(dtype).removeprefix("torch."),
                                                    device.split(":")[0], bucket(seen_numel), batch))
        timed, notes = _measure(runners, native_name, earlier_us, rounds=rounds, retries=retries,
                                min_run_time=min_run_time, clock=clock, device=device, spread_limit=spread_limit)
        if timed is None:
            line = f"{label}: not stored, still disturbed after {retries} re-measurements ({'; '.join(notes[-1:])})"
            if refused is not None:
                refused.append(line)
            else:  # nobody collects them: say so, or an empty profile run would look like success
                warnings.warn(f"profile: {line}", RuntimeWarning, stacklevel=2)
            entries.extend(context)
            continue
        detail = f"re-measured {len(notes)}x: {'; '.join(notes)}" if notes else ""
        for name, t in timed.items():
            first = f"first call {t.first_call_us / 1e3:.1f} ms"
            context.append(ProfileEntry(**commons[name], valid=True, detail="; ".join(x for x in (detail, first) if x),
                                        median_us=t.median_us, iqr_us=t.iqr_us, runs=t.calls,
                                        peak_memory=_peak_memory(device)))
        entries.extend(context)
    return entries


def _quiet(run: Callable[[], Any]) -> Callable[[], Any]:
    def quiet() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run()

    return quiet


def _peak_memory(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else None


CONTENDED_PAUSE = 1.0  # seconds before the first re-measurement of a context timed under contention (then 2, ...)


def _measure(runners: dict[str, Callable[[], Any]], native: str | None, earlier_native_us: float | None, *,
             rounds: int, retries: int, min_run_time: float, clock: Callable[[], float],
             device: str, spread_limit: float) -> tuple[dict[str, noise.Timed] | None, list[str]]:
    """(timings, why each re-measurement was made); timings None when the context stayed disturbed."""
    notes: list[str] = []
    if not runners:
        return {}, notes
    # The calling thread's CPU time beside each block's wall time says which share of it the composite ran (timed in
    # either); an injected clock (tests) has no CPU time to match.
    cpu_clock = time.thread_time if clock is time.perf_counter else None
    wall_clock = time.monotonic if clock is time.thread_time else None
    for attempt in range(retries + 1):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        timed = noise.interleaved(runners, rounds=rounds, min_run_time=min_run_time, clock=clock, cpu_clock=cpu_clock,
                                  wall_clock=wall_clock)
        # The two fastest get as many rounds again, side by side: the ranking between them is what auto acts on.
        top = sorted(timed.values(), key=lambda t: t.median_us)[:2]
        if len(top) == 2:
            noise.interleaved({t.name: runners[t.name] for t in top}, rounds=rounds, clock=clock,
                              cpu_clock=cpu_clock, wall_clock=wall_clock, min_run_time=min_run_time,
                              timed={t.name: t for t in top})
        # Ranked by per-round ratios (noise.relative): a load that every composite of a round shares moves none
        # of them, unless it fell unevenly on them (noise.uneven: another busy thread of this process, holding the
        # GIL, delays each call, so the composite of more calls loses more). Native far from its earlier profile is
        # re-measured once (the earlier profile may be the odd one); only a ranking that stays unstable, or a load
        # that stays uneven, is refused.
        ranking = (noise.unstable(timed) + noise.uneven(timed) + noise.contended(timed)
                   if spread_limit != math.inf else [])
        drift = noise.disturbed(timed, native=native, earlier_native_us=earlier_native_us, spread_limit=math.inf)
        reasons = ranking + drift
        if not ranking and (not drift or attempt > 0):
            return noise.relative(timed), notes
        if attempt == retries:
            notes.append("; ".join(reasons))
            return None, notes
        notes.append("; ".join(reasons))
        if noise.contended(timed):
            time.sleep(CONTENDED_PAUSE * (attempt + 1))  # re-measured once the other processes' burst may be over
    return None, notes
