"""``verify()``: every composite (native included) in every transform context, against a Python loop of native
PyTorch outside any transform. The matrix it returns is what the store keeps and what policy ``auto`` trusts.

Stacks are generated, not listed: every nesting of depth 1 to 3 over ``vmap``, ``grad`` and ``jvp``, plus
``functionalize`` and ``compile`` as the outermost layer of the depth-1 and depth-2 ones. The harness's interpreter
(``registry.harness.interpreter``) builds each stack and its reference layer by layer: grad differentiates
``sum(w * y * y)`` with respect to the first differentiable argument, jvp pushes a fixed tangent forward.

Invalid inputs count too: an entry of a base stack (vmap, grad, jvp nestings) is ``mismatch`` when its composite
accepts, in that context, a fault sample (``registry.harness.samples.fault_samples``) that native PyTorch rejects
per sample (``check_rejections``).
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from registry.core.messages import described
from registry.core.model import Composite
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES, RegistrationError, load
from registry.core.sources import source_hash
from registry.core.stacks import format_stack, parse_stack
from registry.core.status import RANK  # an entry aggregates its samples worst last: "unsupported" only when none ran
from registry.harness import fallback, opinfo
from registry.harness.audit import audit
from registry.harness.checks import batched_names, entry_call, native_call
from registry.harness.comparison import compare, errors
from registry.harness.interpreter import Fn, Layout, differentiates, reference, transformed
from registry.harness.samples import SAMPLES, Args, Sample, fault_name, fault_samples
from registry.store.records import MatrixEntry

BASE_TRANSFORMS = ("vmap", "grad", "jvp")
OUTER_TRANSFORMS = ("functionalize", "compile")
PATTERNS = ("all", "self", "others", "in_dims1")
NO_PATTERN = "-"  # stacks without vmap batch nothing
OPINFO_ITEM = "opinfo"  # the pattern slot of a work item that is an OpInfo op's whole block for one dtype


def default_stacks() -> list[tuple[str, ...]]:
    nested = [s for depth in (1, 2, 3) for s in itertools.product(BASE_TRANSFORMS, repeat=depth)]
    outer = [(o, *s) for o in OUTER_TRANSFORMS for s in nested if len(s) <= 2]
    return nested + outer


# --- inputs --------------------------------------------------------------------------------------------------------


def _inputs(sample: Sample, stack: Sequence[str], pattern: str, seed: int) -> tuple[Args, tuple[Any, ...], Layout]:
    """The fixed arguments, the physical tensor inputs (with a batch dim per vmap layer), and their layout."""
    names = sample.batchable
    base = sample.build(seed)
    n_vmaps = sum(1 for t in stack if t == "vmap")
    batched = batched_names(sample, pattern) if n_vmaps else ()
    sizes = [3, 2, 2][:n_vmaps]
    counter = itertools.count(seed + 1)

    def build(name: str, depth: int) -> torch.Tensor:
        if depth == n_vmaps:
            return sample.build(next(counter))[name]
        return torch.stack([build(name, depth + 1) for _ in range(sizes[depth])])

    tensors = []
    for name in names:
        tensor = build(name, 0) if name in batched else base[name]
        tensors.append(tensor)
    # in_dims1: the outermost batch dim sits at 1 (where the tensor has a dim after it), the rest at 0.
    in_dims = []
    for layer in range(n_vmaps):
        dims = []
        for i, name in enumerate(names):
            if name not in batched:
                dims.append(None)
                continue
            dim = 0
            if pattern == "in_dims1" and layer == 0 and tensors[i].dim() >= 2:
                dim = 1
            dims.append(dim)
        in_dims.append(tuple(dims))
    if pattern == "in_dims1" and n_vmaps:
        tensors = [t.movedim(0, 1) if in_dims[0][i] == 1 else t for i, t in enumerate(tensors)]
    wrt = names.index(sample.differentiable[0]) if sample.differentiable else 0
    return base, tuple(tensors), Layout(tuple(in_dims), wrt)


# --- one check -----------------------------------------------------------------------------------------------------


def check_stack(sample: Sample, stack: tuple[str, ...], pattern: str, call: Callable[[Args], Any],
                seed: int = 0) -> tuple[str, str, float | None, float | None]:
    """(status, detail, max abs error, max rel error) of ``call`` under ``stack`` against the native loop."""
    if differentiates(stack) and not sample.differentiable:
        return "unsupported", f"{sample.dtype} has no gradients", None, None
    base, tensors, layout = _inputs(sample, stack, pattern, seed)
    names = sample.batchable

    def with_tensors(target: Callable[[Args], Any]) -> Fn:
        return lambda *xs: target({**base, **dict(zip(names, xs, strict=True))})

    try:
        expected = reference(stack, with_tensors(native_call(sample.op, sample)), layout)(*tensors)
    except Exception as error:  # the reference itself cannot be computed: nothing to judge against
        return "unsupported", f"reference: {described(error, 200)}", None, None
    expected = expected.detach()
    with fallback.watch() as caught:
        try:
            actual = transformed(stack, with_tensors(call), layout)(*tensors)
        except Exception as error:  # a transform's failure is this check's result
            return "error", described(error, 200), None, None
    if (mismatch := compare(actual, expected, where="")) is not None:
        return "mismatch", mismatch.detail, mismatch.max_abs_error, mismatch.max_rel_error
    abs_error, rel_error = errors(actual, expected)
    if (note := fallback.fallback_note(caught, 200)) is not None:
        return "slow", note, abs_error, rel_error
    return "ok", "", abs_error, rel_error


# --- invalid inputs -----------------------------------------------------------------------------------------------


@functools.cache
def native_rejection(sample: Sample) -> BaseException | None:
    """What native PyTorch raises on the fault sample, outside any transform (per sample, as the reference loop
    calls it), or None where native accepts it (then it is an edge of the valid inputs, not an invalid one).

    The ATen overload itself (the native composite), not ``native_call``, which makes index_fill's indices
    non-negative for the reference's sake and so would hide an index out of range."""
    load()
    native = _direct_call(COMPOSITES[sample.op]["native"], sample)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            native(sample.build(0))
    except Exception as error:  # the error is the result
        return error
    return None


@functools.lru_cache(maxsize=4096)
def _fault_inputs(sample: Sample, n_vmaps: int, pattern: str, seed: int) -> tuple[Args, tuple[Any, ...], Layout]:
    # Built once per fault and batching, shared by every composite and stack with as many vmaps: building batched
    # inputs costs more than running a composite that rejects them. Nothing writes to them (mutating composites
    # clone first).
    return _inputs(sample, ("vmap",) * n_vmaps, pattern, seed)


def rejection(sample: Sample, stack: Sequence[str], pattern: str, call: Callable[[Args], Any],
              seed: int = 0) -> BaseException | None:
    """What ``call`` raises on the fault sample under ``stack`` (batched by ``pattern``), or None if it accepts it."""
    base, tensors, layout = _fault_inputs(sample, sum(1 for t in stack if t == "vmap"), pattern, seed)
    names = sample.batchable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's fallback warning and native's deprecations are not the result here
        try:
            transformed(stack, lambda *xs: call({**base, **dict(zip(names, xs, strict=True))}), layout)(*tensors)
        except Exception as error:  # the error is the result
            return error
    return None


def check_rejections(composite: Composite, dtype: str, stack: tuple[str, ...],
                     pattern: str) -> tuple[str, str] | None:
    """("mismatch", detail) when ``composite`` accepts, under ``stack``, an input that native rejects; else None.

    Runs on the base stacks (vmap, grad, jvp nestings) only: ``compile`` and ``functionalize`` wrap errors in their
    own types and would compile once per fault. A different exception type is not a mismatch here (native's own
    type changes under vmap); ``tests/composites/test_parity.py`` holds every composite to native's type.
    """
    if any(t in OUTER_TRANSFORMS for t in stack):
        return None
    for sample in fault_samples(composite.op):
        if str(sample.dtype).removeprefix("torch.") != dtype:
            continue
        expected = native_rejection(sample)
        if expected is None or (any(t in ("grad", "jvp") for t in stack) and not sample.differentiable):
            continue
        if pattern == "others" and not set(sample.batchable) - {"self"}:
            continue
        if rejection(sample, stack, pattern, _composite_call(composite, sample)) is None:
            return "mismatch", (f"{fault_name(sample)}: accepts what native rejects "
                                f"({described(expected, 200)})")[:500]
    return None


def _composite_call(composite: Composite, sample: Sample) -> Callable[[Args], Any]:
    if composite.kind == "native":
        return entry_call(sample.op, sample)  # PyTorch's own entry point, outside use(): native as users get it
    return _direct_call(composite, sample)


def _direct_call(composite: Composite, sample: Sample) -> Callable[[Args], Any]:
    """``composite.fn`` called with the sample's arguments, keyword-only ones by keyword."""

    def call(args: Args) -> Any:
        positional = [v for k, v in args.items() if k not in sample.kwargs]
        return composite.fn(*positional, **{k: args[k] for k in sample.kwargs if k in args})

    return call


# --- the matrix --------------------------------------------------------------------------------------------------


def _patterns_for(sample: Sample, stack: tuple[str, ...], patterns: Sequence[str]) -> list[str]:
    if "vmap" not in stack:
        return [NO_PATTERN]
    chosen = [p for p in patterns if p != "others" or set(sample.batchable) - {"self"}]
    if "compile" in stack:  # compiling costs about half a second a case: the all-batched pattern stands for all
        chosen = [p for p in chosen if p == "all"] or chosen[:1]
    return chosen


def verify(
    ops: Iterable[str] | None = None,
    stacks: Iterable[str | Sequence[str]] | None = None,
    patterns: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    *,
    composites: Iterable[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    workers: int | None = None,
) -> list[MatrixEntry]:
    """The matrix: one entry per (op, composite, stack, pattern, dtype), the worst outcome over that dtype's samples.

    Stacks default to ``default_stacks()`` ("vmap,grad" strings and aliases such as "jacrev" are accepted);
    ``compile`` stacks run for the first dtype only, and ``progress(done, total, label)`` follows each entry.
    Large runs are split over ``workers`` forked processes (default: up to 2, one per core).
    A composite that fails its audit (``registry.harness.audit``) gets ``error`` entries that say why, without running.
    """
    load()
    op_names = list(ops) if ops is not None else list(OPS)
    stack_list = [parse_stack(s) for s in stacks] if stacks is not None else default_stacks()
    pattern_list = tuple(patterns) if patterns is not None else PATTERNS
    wanted = set(composites) if composites is not None else None
    work = []
    labels: list[tuple[Any, ...]] = []
    for op in op_names:
        for composite in COMPOSITES[op].values():
            if wanted is not None and composite.name not in wanted:
                continue
            if op not in SAMPLES:  # samples from OpInfo: one item per dtype (registry.harness.opinfo)
                continue
            for dtype_index, dtype in enumerate(dtypes):
                samples = [s for s in SAMPLES[op] if s.dtype == dtype]
                for stack in stack_list:
                    if not samples or ("compile" in stack and dtype_index):
                        continue  # compiling is slow: one dtype and one sample stand for the rest
                    use_samples = samples[:1] if "compile" in stack else samples
                    for pattern in _patterns_for(samples[0], stack, pattern_list):
                        work.append((op, composite, dtype, stack, pattern, use_samples))
    for op in op_names:
        if op in SAMPLES:
            continue
        # OpInfo cases: the survey's four stacks; one item per (op, dtype) shares each case and its reference
        # between the composites and cells.
        names = tuple(c.name for c in COMPOSITES[op].values() if wanted is None or c.name in wanted)
        cells = tuple((stack, pattern) for stack in stack_list if stack in opinfo.STACKS
                      for pattern in opinfo.patterns_for(stack) if pattern in pattern_list or pattern == NO_PATTERN)
        if names and cells:
            labels += [(op, names, str(dtype).removeprefix("torch."), cells, OPINFO_ITEM, ())  # type: ignore[misc]
                       for dtype in dtypes]
    labels += [(op, composite.name, str(dtype).removeprefix("torch."), stack, pattern,
                tuple(SAMPLES[op].index(sample) for sample in use_samples))
               for op, composite, dtype, stack, pattern, use_samples in work]
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    if workers <= 1 or len(labels) < 64:
        results = map(_run_item, labels)
    else:
        # Forked workers inherit every registration (plugins and test composites included); each takes one core.
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker)
        results = pool.imap(_run_item, labels, chunksize=8)
    entries = []
    pooled = workers > 1 and len(labels) >= 64
    try:
        for done, produced in enumerate(results, 1):
            entries.extend(produced)
            if progress is not None:
                entry = produced[-1]
                stack = format_stack(entry.stack) or "eager"
                progress(done, len(labels), f"{entry.op}/{entry.composite} {stack} {entry.pattern}")
    except BaseException:
        if pooled:  # Ctrl-C or a failure: stop the workers now (close() would first wait for every queued item)
            pool.terminate()
        raise
    finally:
        if pooled:
            pool.close()
            pool.join()
    return entries


def _init_worker() -> None:
    """A forked worker: one core each, and Ctrl-C left to the parent, which stops the pool (a worker that took it too
    would print its own traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)


_audits: dict[tuple[str, str], str | None] = {}


def _run_item(label: tuple[Any, ...]) -> list[MatrixEntry]:
    """The entries of one work item: an OpInfo op's whole (dtype) block, or one entry of a seed op."""
    op, names, dtype, cells, pattern, _ = label
    if pattern == OPINFO_ITEM:
        hashes = {name: source_hash(COMPOSITES[op][name]) for name in names}
        return opinfo.matrix_entries(op, dtype, names, cells, hashes)
    return [_run_seed_item(label)]


def _run_seed_item(label: tuple[str, str, str, tuple[str, ...], str, tuple[int, ...]]) -> MatrixEntry:
    """One matrix entry: the worst outcome of ``composite`` over the samples, or its failed audit."""
    op, name, dtype, stack, pattern, sample_ids = label
    composite = COMPOSITES[op][name]
    if (op, name) not in _audits:
        try:
            audit(op, name)
            _audits[op, name] = None
        except RegistrationError as error:
            _audits[op, name] = f"audit: {error}"
    failed_audit = _audits[op, name]
    worst: tuple[str, str, float | None, float | None] = ("unsupported", "no sample of this dtype", None, None)
    if failed_audit is not None:
        worst = ("error", failed_audit[:500], None, None)
    for sample in [SAMPLES[op][i] for i in sample_ids] if failed_audit is None else ():
        if pattern == "others" and not set(sample.batchable) - {"self"}:
            continue
        outcome = check_stack(sample, stack, pattern, _composite_call(composite, sample))
        if outcome[0] != "ok":
            outcome = (outcome[0], f"{sample.name}: {outcome[1]}", outcome[2], outcome[3])
        if RANK.index(outcome[0]) > RANK.index(worst[0]):
            worst = outcome
        elif worst[2] is None:
            worst = (worst[0], worst[1], outcome[2], outcome[3])
    if failed_audit is None and RANK.index(worst[0]) < RANK.index("mismatch"):
        accepted = check_rejections(composite, dtype, stack, pattern)
        if accepted is not None:
            worst = (accepted[0], accepted[1], worst[2], worst[3])
    return MatrixEntry(
        op=op, composite=name, kind=composite.kind, stack=stack, pattern=pattern, dtype=dtype, status=worst[0],
        detail=worst[1], max_abs_error=worst[2], max_rel_error=worst[3], source_hash=source_hash(composite),
        torch_version=torch.__version__, device="cpu", measured_at=time.time(),
    )


