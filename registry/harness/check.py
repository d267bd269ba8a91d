"""``registry.check``: is a user's transformed function right natively and inside ``use()``, what did ``use()``
change, and what does each cost.

The user's per-sample function runs three ways on their own arguments: natively under the transform (torch.func
alone), inside ``use()`` under the same transform, and as the per-sample reference outside any transform, built by
the harness's one interpreter (``registry.harness.interpreter.reference``: a Python loop over the batch for vmap,
``torch.autograd.grad`` for grad, one ``autograd.grad`` per output element for the Jacobians). Each run's result is
compared with the reference's, output by output, within a row of the one tolerance table
(``registry.harness.comparison.TOLERANCES``: ``derivatives`` where the transform differentiates, ``batched values``
where it does not), with vmap's fallback warning turned on (``registry.harness.fallback``).

A run's verdict is one of ``VERDICTS``: ``ok`` (equal to the reference, no fallback), ``slow`` (equal, but vmap ran
some op in its per-sample loop: the ops are named), ``mismatch`` (a result differs from the reference, or has
another shape: silently wrong), ``error`` (it raised: the first line and the user's innermost frame are kept).
Where the reference itself fails (the function fails outside any transform) nothing can be compared: a run that
did not raise is ``unchecked``.

For the run inside ``use()`` the report lists every routing decision taken (op, stack, composite, kind, reason,
routed calls), the vmapped functions functionalized automatically (an in-place write into a fresh buffer) and the
batch splits; the three timings are thread CPU time, ``torch.set_num_threads(1)``, in interleaved rounds.
"""

from __future__ import annotations

import inspect
import os
import re
import statistics
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path  # noqa: PLC2701 - PyTorch's pytree

from registry.core import functionalization
from registry.core.batch_split import BatchSplitWarning
from registry.core.frames import is_user_file, raising_user_frame
from registry.core.messages import described, first_line
from registry.core.recording import RecordedDecision
from registry.core.registration import TABLE
from registry.core.routing import use
from registry.core.selector import POLICIES
from registry.core.stacks import format_stack
from registry.harness import comparison, fallback, interpreter

VERDICTS: tuple[str, ...] = ("ok", "slow", "mismatch", "error")
UNCHECKED = "unchecked"  # the reference failed: nothing to compare a run that did not raise with
DEFAULT_ROUNDS = 5  # the command line's --rounds default too


class CheckError(ValueError):
    """The check cannot run as asked: an unknown transform or policy, in_dims or argnums that do not fit the
    arguments, or a function that does not take them. The message says what and what to do."""


@dataclass(frozen=True)
class OutputDifference:
    """One output (a tensor of the result, named by its place: ``result['fc.weight']``) against the reference."""

    name: str
    ok: bool
    max_abs: float | None  # None: shapes or dtypes differ, so no entry-by-entry difference
    max_rel: float | None
    detail: str = ""  # why it is not ok


@dataclass(frozen=True)
class Run:
    """One side of the check: native or use(), under the transform."""

    name: str
    verdict: str
    error: str | None = None  # the error's first line (type: message)
    where: str | None = None  # the user's innermost frame where it raised: file:line (`source`)
    fallbacks: tuple[str, ...] = ()  # the ops vmap ran in its per-sample loop
    differences: tuple[OutputDifference, ...] = ()
    time_s: float | None = None  # median thread CPU time of one call

    @property
    def worst(self) -> OutputDifference | None:
        """The output farthest from the reference (relative), or None when nothing was compared."""
        measured = [d for d in self.differences if d.max_rel is not None]
        failing = [d for d in self.differences if not d.ok]
        if failing:
            return max(failing, key=lambda d: (d.max_rel is None, d.max_rel or 0.0))
        return max(measured, key=lambda d: d.max_rel or 0.0) if measured else None


@dataclass(frozen=True)
class ReferenceRun:
    error: str | None = None
    where: str | None = None
    time_s: float | None = None


@dataclass(frozen=True)
class DecisionTaken:
    """One routing decision inside use(): ``calls`` counts the op's routed calls in the run (all its contexts)."""

    op: str
    stack: str
    batched: tuple[str, ...]
    composite: str
    kind: str
    reason: str
    calls: int


@dataclass(frozen=True)
class CheckReport:
    function: str
    transform: str
    in_dims: tuple[int | None, ...]
    argnums: int | tuple[int, ...]
    policy: str
    tolerance: str  # the row of comparison.TOLERANCES the outputs were compared at
    bounds: dict[str, tuple[float, float]]  # (rtol, atol) per compared dtype
    reference: ReferenceRun
    native: Run
    use: Run
    decisions: tuple[DecisionTaken, ...] = ()
    functionalized: tuple[str, ...] = ()  # the vmapped functions functionalized automatically inside use()
    splits: tuple[str, ...] = ()  # the batch splits inside use(), one line each
    timing: str = ""  # how the times were measured
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether use() is right and fast: its verdict is ok."""
        return self.use.verdict == "ok"

    def summary(self) -> str:
        """One sentence: what the check found."""
        native, inside = self.native.verdict, self.use.verdict
        if native == "mismatch" and inside in ("ok", "slow"):
            worst = self.native.worst
            where = f" ({worst.name}: {worst.detail})" if worst is not None else ""
            return (f"native is silently wrong{where}; inside use() the result equals the per-sample reference"
                    + (" (in vmap's per-sample loop for some ops)" if inside == "slow" else ""))
        if native == "error" and inside in ("ok", "slow"):
            return "native raises; inside use() the result equals the per-sample reference"
        if native == "slow" and inside == "ok":
            return ("native is right but falls back to vmap's per-sample loop for "
                    f"{', '.join(self.native.fallbacks)}; inside use() it is right with no fallback")
        if inside == "ok":
            return "right natively and inside use()"
        if inside == UNCHECKED:
            return f"the function fails outside any transform too: {self.reference.error}"
        if inside == "error":
            return f"use() raises: {self.use.error}"
        if inside == "mismatch":
            return "inside use() the result differs from the per-sample reference"
        return f"inside use() the result is right, but vmap loops per sample for {', '.join(self.use.fallbacks)}"

    def __str__(self) -> str:
        lines = [f"check {self.function} under {self.transform} (policy {self.policy}): {self.summary()}", ""]
        rows = [("run", "verdict", "time", "worst output", "max abs", "max rel", "detail")]
        for run in (self.native, self.use):
            worst = run.worst
            detail = (f"{run.error} at {run.where}" if run.where else run.error) if run.error else (
                f"fallback: {', '.join(run.fallbacks)}" if run.fallbacks else (worst.detail if worst else ""))
            rows.append((run.name, run.verdict, _ms(run.time_s), worst.name if worst else "-",
                         _number(worst.max_abs if worst else None), _number(worst.max_rel if worst else None),
                         detail))
        reference = self.reference.error or ""
        rows.append(("reference", "error" if self.reference.error else "-", _ms(self.reference.time_s), "-", "-", "-",
                     f"{reference} at {self.reference.where}" if self.reference.where else reference))
        lines += _columns(rows)
        if self.decisions:
            lines += ["", "decisions inside use():"]
            lines += _columns([("op", "stack", "composite", "kind", "calls", "reason")] + [
                (d.op, d.stack + (f" ({', '.join(d.batched)} batched)" if d.batched else ""), d.composite, d.kind,
                 str(d.calls), d.reason) for d in self.decisions])
        else:
            lines += ["", "decisions inside use(): none (no covered op was called under the transform)"]
        for name in self.functionalized:
            lines.append(f"functionalized automatically: {name}")
        for split in self.splits:
            lines.append(f"batch split: {split}")
        tolerances = ", ".join(f"{dtype} rtol {rtol:g} atol {atol:g}" for dtype, (rtol, atol) in self.bounds.items())
        lines += ["", f"compared at the {self.tolerance!r} tolerance ({tolerances or 'no tensors compared'}); "
                      f"{self.timing}"]
        lines += list(self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The whole report as JSON-ready values."""
        data = asdict(self)
        data["ok"] = self.ok
        data["summary"] = self.summary()
        data["bounds"] = {dtype: list(bound) for dtype, bound in self.bounds.items()}
        data["in_dims"] = list(self.in_dims)
        data["argnums"] = self.argnums if isinstance(self.argnums, int) else list(self.argnums)
        return _finite(data)


def _finite(value: Any) -> Any:
    """JSON has no inf or nan: they become strings."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[i]) if i < len(row) - 1 else cell for i, cell in enumerate(row)).rstrip()
            for row in rows]


# --- what use() decided: the one adapter --------------------------------------------------------------------------

def decisions_of(recorded: Sequence[RecordedDecision]) -> tuple[DecisionTaken, ...]:
    """The decisions a ``use(record=True)`` block took, one per (op, stack, batched arguments, composite), with the
    calls each routed."""
    merged: dict[tuple, DecisionTaken] = {}
    for decision in recorded:
        key = (decision.op, decision.stack, decision.batched, decision.composite)
        earlier = merged.get(key)
        merged[key] = DecisionTaken(op=decision.op, stack=format_stack(decision.stack), batched=decision.batched,
                                    composite=decision.composite, kind=decision.kind, reason=decision.reason,
                                    calls=decision.calls + (earlier.calls if earlier is not None else 0))
    return tuple(merged.values())


# torch's and the harness's own wrappers: the user's function is the other code of a functionalized key.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def _functionalized_names(keys: set[tuple[object, ...]]) -> tuple[str, ...]:
    """The user's functions among what was functionalized: name and file:line of each function's code."""
    names = []
    for key in keys:
        codes = [part for part in key if isinstance(part, types.CodeType)]
        user = ([c for c in codes if is_user_file(c.co_filename)]
                or [c for c in codes if not c.co_filename.startswith(_LIBRARY_DIRS)] or codes)
        if user:
            code = user[0]
            names.append(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})")
    return tuple(sorted(set(names)))


# --- running it ---------------------------------------------------------------------------------------------------


def _normalized_in_dims(in_dims: Any, count: int) -> tuple[int | None, ...]:
    if in_dims is None or (isinstance(in_dims, int) and not isinstance(in_dims, bool)):
        return (in_dims,) * count
    if not isinstance(in_dims, (tuple, list)) or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in in_dims):
        raise CheckError(f"in_dims {in_dims!r} is not an int, None, or a tuple of them (one per argument, as "
                         "torch.func.vmap takes it)")
    if len(in_dims) != count:
        raise CheckError(f"in_dims {tuple(in_dims)!r} has {len(in_dims)} entries for {count} arguments; give one "
                         "per argument (None: not batched)")
    return tuple(in_dims)


def _check_batching(args: Sequence[Any], in_dims: tuple[int | None, ...]) -> None:
    sizes = set()
    for i, (arg, d) in enumerate(zip(args, in_dims, strict=True)):
        if d is None:
            continue
        tensors = [t for _, t in tree_flatten_with_path(arg)[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            raise CheckError(f"in_dims[{i}] = {d} batches argument {i}, which holds no tensor; give None for it")
        for t in tensors:
            if t.dim() == 0 or not -t.dim() <= d < t.dim():
                dims = f"a dim in 0..{t.dim() - 1}, or " if t.dim() else ""
                raise CheckError(f"in_dims[{i}] = {d} is out of range for argument {i}'s tensor of shape "
                                 f"{tuple(t.shape)}; give {dims}None for an argument that is not batched")
            sizes.add(t.shape[d])
    if not sizes:
        raise CheckError("in_dims batches no argument: give 0 (or a dim) for the arguments that hold the batch")
    if len(sizes) > 1:
        raise CheckError(f"the batched arguments have different batch sizes ({', '.join(map(str, sorted(sizes)))}) "
                         "along their in_dims; they must agree")


def _per_sample(args: Sequence[Any], in_dims: tuple[int | None, ...]) -> tuple[Any, ...]:
    """The first sample of each batched argument (what the function sees under vmap)."""
    from torch.utils._pytree import tree_map  # noqa: PLC2701 - PyTorch's pytree

    return tuple(arg if d is None else tree_map(lambda t, d=d: t.select(d, 0) if isinstance(t, torch.Tensor) else t,
                                                 arg) for arg, d in zip(args, in_dims, strict=True))


def _failure(error: BaseException) -> tuple[str, str | None]:
    frame = raising_user_frame(error.__traceback__)
    return described(error), frame.describe() if frame is not None else None


def _aten_name(fallback_op: str) -> str:
    """``aten::_foo.default`` or ``aten::foo`` as the overload packet ``_foo``."""
    return fallback_op.removeprefix("aten::").partition(".")[0]


def _chosen_loops(decisions: Sequence[DecisionTaken]) -> dict[str, str]:
    """aten packet -> covered op, for every op use() decided to run natively under a vmap: its own overloads and
    the derivative ops that follow its decision (a fused kernel's forward and backward)."""
    table = TABLE
    chosen: dict[str, str] = {}
    for decision in decisions:
        if decision.kind != "native" or "vmap" not in decision.stack or decision.op not in table.ops:
            continue
        names = [o.name for o in table.ops[decision.op].overloads] + list(table.derivatives.get(decision.op, {}))
        for name in names:
            chosen[name.partition(".")[0]] = decision.op
    return chosen


def _fallback_ops(caught: Sequence[warnings.WarningMessage]) -> tuple[str, ...]:
    ops = []
    for w in caught:
        text = str(w.message)
        if fallback.FALLBACK_WARNING in text:
            found = re.search(r"batching rule for ([\w:.]+?)\.\s", text)
            ops.append(found.group(1) if found else first_line(w.message, 120))
    return tuple(dict.fromkeys(ops))


def _named_tensors(result: Any) -> list[tuple[str, Any]]:
    leaves, _ = tree_flatten_with_path(result)
    return [("result" + keystr(path), leaf) for path, leaf in leaves]


def _differences(actual: Any, expected: Any, tolerance: str) -> tuple[OutputDifference, ...]:
    got, want = _named_tensors(actual), _named_tensors(expected)
    if [name for name, _ in got] != [name for name, _ in want]:
        detail = (f"the result's structure differs from the reference's: {len(got)} outputs "
                  f"({', '.join(n for n, _ in got[:3])}{', ...' if len(got) > 3 else ''}) against {len(want)}")
        return (OutputDifference("result", False, None, None, detail),)
    out = []
    for (name, a), (_, e) in zip(got, want, strict=True):
        found = comparison.compare(a, e, tolerance=tolerance, where="")
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and a.shape == e.shape:
            max_abs, max_rel = comparison.errors(a, e)
        else:
            max_abs = max_rel = None
        out.append(OutputDifference(name, found is None, max_abs, max_rel, found.detail if found else ""))
    return tuple(out)


def _bounds(result: Any, tolerance: str) -> dict[str, tuple[float, float]]:
    row = comparison.TOLERANCES[tolerance]
    dtypes = {leaf.dtype for _, leaf in _named_tensors(result) if isinstance(leaf, torch.Tensor)}
    return {str(d).removeprefix("torch."): row.bounds(d) for d in sorted(dtypes, key=str)}


@dataclass
class _Outcome:
    result: Any = None
    error: BaseException | None = None
    caught: list[warnings.WarningMessage] = field(default_factory=list)


def _run(call: Callable[[], Any]) -> _Outcome:
    outcome = _Outcome()
    with fallback.watch() as caught:
        try:
            outcome.result = call()
        except Exception as error:  # the user's function may raise anything: it is the report's to say
            outcome.error = error
    outcome.caught = list(caught)
    return outcome


def _side(name: str, outcome: _Outcome, reference: _Outcome, tolerance: str) -> Run:
    if outcome.error is not None:
        error, where = _failure(outcome.error)
        return Run(name, "error", error=error, where=where, fallbacks=_fallback_ops(outcome.caught))
    fallbacks = _fallback_ops(outcome.caught)
    if reference.error is not None:
        return Run(name, UNCHECKED, fallbacks=fallbacks)
    differences = _differences(outcome.result, reference.result, tolerance)
    verdict = "mismatch" if not all(d.ok for d in differences) else "slow" if fallbacks else "ok"
    return Run(name, verdict, fallbacks=fallbacks, differences=differences)


def _times(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median thread CPU time per call of each, in interleaved rounds (the order rotates each round), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    start = time.thread_time()
                    calls[name]()
                    samples[name].append(time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(values) for name, values in samples.items()}


def _describe_function(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def check(fn: Callable[..., Any], *args: Any, transform: str = "vmap(grad)", in_dims: Any = 0,
          argnums: int | tuple[int, ...] = 0, policy: str = "auto", rounds: int = DEFAULT_ROUNDS) -> CheckReport:
    """Run ``fn`` (a per-sample function) on ``args`` under ``transform`` natively and inside ``use(policy)``,
    compare both with the per-sample reference outside any transform, and time the three.

    ``in_dims``: each argument's batch dim for every vmap layer (an int for all, or one per argument, None for an
    unbatched one such as a dict of parameters), as ``torch.func.vmap`` takes it; ``argnums``: what grad, the
    Jacobians and hessian differentiate (an argument may be a dict of tensors). grad and hessian differentiate
    ``fn``'s result itself, which must be a scalar. Raises ``CheckError`` where the check cannot run as asked.
    """
    try:
        stack = interpreter.program(transform)
    except ValueError as error:
        raise CheckError(str(error)) from None
    if not stack:
        raise CheckError("the transform is empty; give one such as vmap(grad), vmap, jacrev or vmap(hessian)")
    if policy not in POLICIES:
        raise CheckError(f"unknown policy {policy!r}; policies are {', '.join(POLICIES)}")
    if rounds < 1:
        raise CheckError(f"rounds must be at least 1, not {rounds}")
    vmaps = stack.count("vmap")
    dims = _normalized_in_dims(in_dims, len(args))
    if vmaps:
        _check_batching(args, dims)
    argnum_tuple = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if interpreter.differentiates(stack):
        bad = [a for a in argnum_tuple if not isinstance(a, int) or not 0 <= a < len(args)]
        if bad or not argnum_tuple:
            raise CheckError(f"argnums {argnums!r} does not name arguments of the {len(args)} given; give positions "
                             f"0..{len(args) - 1}")
    try:
        inspect.signature(fn).bind(*(_per_sample(args, dims) if vmaps else args))
    except TypeError as error:
        raise CheckError(f"{_describe_function(fn)} does not take the {len(args)} example arguments: {error}") \
            from None
    except ValueError:  # no signature to read (a builtin): calling it says
        pass

    layout = interpreter.Layout(in_dims=(dims,) * vmaps, wrt=argnums, loss=lambda y: y)
    transformed = interpreter.transformed(stack, fn, layout)
    reference_fn = interpreter.reference(stack, fn, layout)
    tolerance = "derivatives" if interpreter.differentiates(stack) else "batched values"

    def native() -> Any:
        with use(policy="native"):
            return transformed(*args)

    def inside() -> Any:
        with use(policy=policy):
            return transformed(*args)

    def loop() -> Any:
        with use(policy="native"):
            return reference_fn(*args)

    recorded: list[RecordedDecision] = []

    def inside_recorded() -> Any:  # the checked run: what use() decided, and how often (timed runs do not record)
        with use(policy=policy, record=True) as block:
            try:
                return transformed(*args)
            finally:
                recorded.extend(block.decisions)

    with functionalization.remembering_apart():
        reference = _run(loop)
        native_outcome = _run(native)
        use_outcome = _run(inside_recorded)
        decisions = decisions_of(recorded)
        functionalized = _functionalized_names(set(functionalization.FUNCTIONALIZED))
        splits = tuple(first_line(w.message) for w in use_outcome.caught
                       if issubclass(w.category, BatchSplitWarning))
        timed = {name: call for name, call, outcome in (("native", native, native_outcome), ("use", inside,
                                                                                          use_outcome),
                                                         ("reference", loop, reference))
                 if outcome.error is None}
        times = _times(timed, rounds) if timed else {}

    native_run = _side("native", native_outcome, reference, tolerance)
    use_run = _side("use()", use_outcome, reference, tolerance)
    native_run = replace(native_run, time_s=times.get("native"))
    use_run = replace(use_run, time_s=times.get("use"))
    reference_run = ReferenceRun(*(_failure(reference.error) if reference.error is not None else (None, None)),
                                 time_s=times.get("reference"))
    notes: tuple[str, ...] = ()
    chosen_loops = _chosen_loops(decisions)
    if use_run.verdict == "slow" and all(_aten_name(op) in chosen_loops for op in use_run.fallbacks):
        # NOTE: the selector ran PyTorch's own op in vmap's loop by choice (cost at these sizes, or no composite
        # valid): the loop is the fastest known way there, so it is not held against use(). A loop of any other op
        # (an uncovered one) still makes the run slow.
        use_run = replace(use_run, verdict="ok")
        ops = sorted({chosen_loops[_aten_name(op)] for op in use_run.fallbacks})
        notes += (f"use() kept PyTorch's own {', '.join(ops)} in vmap's per-sample loop by choice (see each "
                  "decision's reason)",)
    if native_run.time_s and use_run.time_s and use_run.verdict == "ok" and native_run.verdict in ("ok", "slow") \
            and use_run.time_s > native_run.time_s * 1.1:
        notes += (f"use() took {use_run.time_s / native_run.time_s:.2f}x native's time here "
                 f"({rounds} round{'s' if rounds != 1 else ''}; more rounds give a steadier ratio)",)
    return CheckReport(
        function=_describe_function(fn), transform=format_stack(stack), in_dims=dims, argnums=argnums, policy=policy,
        tolerance=tolerance, bounds=_bounds(reference.result, tolerance) if reference.error is None else {},
        reference=reference_run, native=native_run, use=use_run, decisions=decisions,
        functionalized=functionalized, splits=splits,
        timing=f"times: median thread CPU time of {rounds} interleaved round{'s' if rounds != 1 else ''}, one "
               "thread", notes=notes)
