"""The conformance suite: functorch's OpInfo checks over every covered op, natively and inside ``registry.use()``.

In the image of PyTorch's own functorch tests (``test_ops.py``'s vjp, jvp, vmapvjp, vjpvmap, vmapjvp, jvpvjp and
``test_vmap.py``'s exhaustive vmap), built on the interpreter of OpInfo cases (``registry.harness.case_stacks``:
``run_stack`` under the stack, ``reference`` outside any transform, ``compare``). For every op_db entry of a
covered op (``define_op(..., opinfo=...)``), every OpInfo sample (degenerate ones included: empty tensors, 0-d,
size-1 and zero-size dimensions) and both dtypes, each check runs once natively and once inside ``use()``:

- ``vjp``: the gradient of ``sum(w * y)`` (survey stack ``grad``), per batching variant (which arguments are
  differentiated: ``sample.input``'s tensors, or the others');
- ``jvp``: outputs and tangents of ``torch.func.jvp``;
- ``vmap``: exhaustive over in_dims: every subset of the tensor arguments batched (singletons and all of them when
  there are more than three), the batch dimension first and last;
- ``vmap(vjp)``, ``vjp(vmap)``, ``vmap(jvp)``, ``jvp(vjp)`` (forward over reverse: a Hessian-vector product);
- depth 3 with an inner gradient: ``vjp(vmap(vjp))`` (meta-learning's grad over a vmap of inner gradients),
  ``vmap(vjp(vjp))``, ``jacrev(vmap(vjp))``, on ops with a double backward;
- ``no fallback warning``: each batched check above ran without vmap's "performance drop" warning.

The invariant: no check that passes natively fails inside ``use()``. A check passes when its values equal the
reference (a slow pass is still a pass of the value check, and a failure of ``no fallback warning``); a check that
cannot be run on a sample (no floating argument, a random op, a reference native cannot compute) counts for neither.
"""

from __future__ import annotations

import datetime
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten  # noqa: PLC2701 - PyTorch's pytree

from registry.core.messages import described
from registry.harness import case_stacks, deadline, fork_pool, outcomes
from registry.harness import opinfo_cases as cases

# check -> the interpreter's stack
CHECKS: dict[str, str] = {
    "vjp": "grad",
    "jvp": "jvp",
    "vmap": "vmap",
    "vmap(vjp)": "vmap(grad)",
    "vjp(vmap)": "grad(vmap)",
    "vmap(jvp)": "vmap(jvp)",
    "jvp(vjp)": "jvp(grad)",
    # Depth 3 with an inner gradient (meta-learning, per-sample second derivatives): every case behind the full
    # run's options; the test suite runs a sample of them (tests/registry/harness/test_conformance.py).
    "vjp(vmap(vjp))": "grad(vmap(grad))",
    "vmap(vjp(vjp))": "vmap(grad(grad))",
    "jacrev(vmap(vjp))": "jacrev(vmap(grad))",
}
DEPTH3_CHECKS: tuple[str, ...] = ("vjp(vmap(vjp))", "vmap(vjp(vjp))", "jacrev(vmap(vjp))")
NO_FALLBACK = "no fallback warning"
ALL_CHECKS: tuple[str, ...] = (*CHECKS, NO_FALLBACK)
_BATCHED_CHECKS = frozenset({"vmap", "vmap(vjp)", "vjp(vmap)", "vmap(jvp)", *DEPTH3_CHECKS})
EXHAUSTIVE_SUBSETS_UP_TO = 3  # tensor arguments: beyond this many, vmap batches each alone and all together
DEFAULT_SAMPLE_LIMIT = 0  # 0: every sample OpInfo generates
GENERATED_SAMPLES = 512  # OpInfo's generators are finite; a bound in case one is not
BATCH = 2


class ConformanceError(ValueError):
    """Bad conformance input: an op that is not covered, or a check that does not exist."""


@dataclass(frozen=True)
class Verdict:
    """One check on one sample, one way of batching: natively and inside use()."""

    check: str
    sample: int
    how: str  # the batching variant, or the batched arguments and the batch dimension for vmap
    native: outcomes.Outcome
    used: outcomes.Outcome


@dataclass
class ConformanceRow:
    """One op_db entry, check and dtype over all samples: how many cases passed natively and inside use()."""

    op: str  # the covered op
    entry: str  # the op_db entry
    check: str
    dtype: str
    cases: int  # cases checked both ways (neither side unsupported)
    native_passed: int
    use_passed: int
    newly_passing: int  # failed natively, pass inside use()
    newly_failing: int  # passed natively, fail inside use(): the invariant says 0
    degenerate_cases: int  # cases among ``cases`` on a sample with an empty, 0-d or size-1 dimension tensor
    detail: str  # the first newly failing case, else the first case failing both ways, else ""
    torch_version: str
    timestamp: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ConformanceConfig:
    checks: tuple[str, ...] = ALL_CHECKS
    sample_limit: int = DEFAULT_SAMPLE_LIMIT
    case_timeout_s: float = deadline.DEFAULT_CASE_TIMEOUT_S


def covered_entries(ops: Iterable[str] | None = None) -> list[tuple[str, Any]]:
    """(covered op, op_db entry) for every entry the covered ops name (``define_op(..., opinfo=...)``)."""
    from registry.core.ops import OPS
    from registry.core.registration import load
    from registry.harness import opinfo

    load()
    names = list(ops) if ops else list(OPS)
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise ConformanceError(f"not covered ops: {', '.join(unknown)}; list the covered ops with "
                               "`multicomposite ops`")
    return [(name, entry) for name in names for entry in opinfo.entries(name)]


def parse_checks(names: Iterable[str] | None) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(names or ALL_CHECKS))
    unknown = [name for name in chosen if name not in ALL_CHECKS]
    if unknown:
        raise ConformanceError(f"unknown checks {', '.join(unknown)}; valid: {', '.join(ALL_CHECKS)}")
    return chosen


def degenerate(sample: Any) -> bool:
    """Whether a tensor of the sample is empty, 0-d or has a dimension of size 1."""
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return any(t.numel() == 0 or t.dim() == 0 or 1 in t.shape for t in leaves if isinstance(t, torch.Tensor))


def samples_of(entry: Any, dtype: torch.dtype, limit: int = DEFAULT_SAMPLE_LIMIT) -> list[Any]:
    """OpInfo's samples of ``entry`` in order, every one (``limit`` 0) or the first ``limit``."""
    found = []
    for sample in entry.sample_inputs("cpu", dtype, requires_grad=False):
        found.append(sample)
        if len(found) >= (limit or GENERATED_SAMPLES):
            break
    return found


def _vmap_layouts(case_leaves: Sequence[Any]) -> list[tuple[tuple[int, ...], bool]]:
    """(batched tensor leaves, batch dimension last) for the exhaustive vmap check."""
    tensors = [i for i, leaf in enumerate(case_leaves) if isinstance(leaf, torch.Tensor)]
    if len(tensors) <= EXHAUSTIVE_SUBSETS_UP_TO:
        subsets = [c for r in range(1, len(tensors) + 1) for c in itertools.combinations(tensors, r)]
    else:
        subsets = [(i,) for i in tensors] + [tuple(tensors)]
    layouts = []
    for subset in subsets:
        layouts.append((subset, False))
        if any(case_leaves[i].dim() > 0 for i in subset):  # for 0-d tensors first and last are the same place
            layouts.append((subset, True))
    return layouts


def _cases(entry: Any, sample: Any, check: str, random: bool) -> list[tuple[str, cases.SurveyCase | outcomes.Outcome]]:
    if check == "vmap":
        leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
        made = []
        for subset, last in _vmap_layouts(leaves):
            how = f"in_dims={'-1' if last else '0'} on leaves {','.join(map(str, subset))}"
            try:
                case: cases.SurveyCase | outcomes.Outcome = cases.SurveyCase(entry, sample, "input", BATCH,
                                                                             leaves=subset, last_dim=last)
                case.random = random
                case.dynamic = cases.is_dynamic(entry, sample, case.batched)
            except Exception as error:
                case = outcomes.Outcome("unsupported", f"cannot build per-sample arguments: {described(error)}")
            made.append((how, case))
        return made
    return [(batching, cases.prepare_case(entry, sample, batching, BATCH, random)) for batching in cases.BATCHINGS]


def check_entry(entry: Any, dtype_name: str, config: ConformanceConfig) -> tuple[list[Verdict], list[Any]]:
    """Every check of ``config`` on every sample of ``entry`` at one dtype, natively and inside use(); and the
    samples."""
    dtype = getattr(torch, dtype_name)
    if dtype not in entry.supported_dtypes("cpu"):
        return [], []
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        torch.manual_seed(cases.SEED)
        samples = samples_of(entry, dtype, config.sample_limit)
        verdicts = []
        for index, sample in enumerate(samples):
            random = cases.sample_is_random(entry, sample)
            for check in config.checks:
                if check == NO_FALLBACK:
                    continue
                stack = CHECKS[check]
                for how, case in _cases(entry, sample, check, random):
                    if isinstance(case, outcomes.Outcome):
                        verdicts.append(Verdict(check, index, how, case, case))
                        continue
                    reference = case_stacks.Reference(case)
                    results = [case_stacks.dynamic_outcome(case, stack, case_stacks.check_case(
                        stack, case, reference, dtype, inside_use=inside, timeout_s=config.case_timeout_s))
                        for inside in (False, True)]
                    verdicts.append(Verdict(check, index, how, results[0], results[1]))
        return verdicts, samples


def value_pass(outcome: outcomes.Outcome) -> bool | None:
    """Whether the values were right (None: not checked)."""
    return None if outcome.status == "unsupported" else outcome.status in ("ok", "slow")


def warning_pass(outcome: outcomes.Outcome) -> bool | None:
    """Whether a check with right values ran without vmap's fallback warning (None: not checked)."""
    return None if outcome.status not in ("ok", "slow") else outcome.status == "ok"


def rows_of(op: str, entry: Any, dtype_name: str, verdicts: Sequence[Verdict], samples: Sequence[Any],
            checks: Sequence[str]) -> list[ConformanceRow]:
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for check in checks:
        if check == NO_FALLBACK:
            judged = [(v, warning_pass(v.native), warning_pass(v.used)) for v in verdicts if v.check in _BATCHED_CHECKS]
        else:
            judged = [(v, value_pass(v.native), value_pass(v.used)) for v in verdicts if v.check == check]
        both = [(v, n, u) for v, n, u in judged if n is not None and u is not None]
        newly_failing = [v for v, n, u in both if n and not u]
        failing_both = [v for v, n, u in both if not n and not u]
        shown = newly_failing[0] if newly_failing else failing_both[0] if failing_both else None
        detail = "" if shown is None else (
            f"#{shown.sample} {shown.check} {shown.how}: native {shown.native.status} {shown.native.detail[:200]}; "
            f"use() {shown.used.status} {shown.used.detail[:200]}")
        rows.append(ConformanceRow(
            op=op, entry=cases.entry_id(entry), check=check, dtype=dtype_name, cases=len(both),
            native_passed=sum(bool(n) for _, n, _ in both), use_passed=sum(bool(u) for _, _, u in both),
            newly_passing=sum(1 for _, n, u in both if not n and u), newly_failing=len(newly_failing),
            degenerate_cases=sum(1 for v, _, _ in both if degenerate(samples[v.sample])), detail=detail,
            torch_version=torch.__version__, timestamp=stamp))
    return rows


def conform_entry(job: tuple[str, Any], dtype_name: str, config: ConformanceConfig) -> list[ConformanceRow]:
    """The rows of one (covered op, op_db entry) at one dtype."""
    op, entry = job
    if getattr(torch, dtype_name) not in entry.supported_dtypes("cpu"):
        return []
    verdicts, samples = check_entry(entry, dtype_name, config)
    return rows_of(op, entry, dtype_name, verdicts, samples, config.checks)


def _crash_rows(job: tuple[str, Any], dtype_name: str, config: ConformanceConfig, why: str) -> list[ConformanceRow]:
    op, entry = job
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # Nothing was measured: a crash counts as one newly failing case, so that it cannot pass unseen.
    return [ConformanceRow(op=op, entry=cases.entry_id(entry), check=check, dtype=dtype_name, cases=1,
                           native_passed=1, use_passed=0, newly_passing=0, newly_failing=1, degenerate_cases=0,
                           detail=f"conformance worker: {why}", torch_version=torch.__version__, timestamp=stamp)
            for check in config.checks]


@dataclass
class ConformanceRun:
    rows: list[ConformanceRow] = field(default_factory=list)
    seconds: float = 0.0


def run_conformance(jobs: Sequence[tuple[str, Any]], dtypes: Sequence[str], config: ConformanceConfig, *,
                    workers: int = 0, job_timeout_s: float = 1200.0,
                    on_rows: Callable[[list[ConformanceRow], int, int], None] | None = None) -> ConformanceRun:
    """Every (covered op, entry) of ``jobs`` at ``dtypes``; ``workers`` > 0 forks that many processes (the survey's
    pool: a crashed or hung job becomes rows that count as newly failing)."""
    for dtype_name in dtypes:
        if dtype_name not in cases.DTYPES:
            raise ConformanceError(f"unknown dtype {dtype_name!r}; valid: {', '.join(cases.DTYPES)}")
    work = [(index, dtype_name) for index in range(len(jobs)) for dtype_name in dtypes]
    result = ConformanceRun()
    done = 0
    start = time.perf_counter()

    def finished(rows: list[ConformanceRow]) -> None:
        nonlocal done
        done += 1
        result.rows.extend(rows)
        if on_rows is not None:
            on_rows(rows, done, len(work))

    if workers <= 0:
        for index, dtype_name in work:
            finished(conform_entry(jobs[index], dtype_name, config))
    else:
        fork_pool.run_forked(jobs, work, config, workers, job_timeout_s, finished, work=conform_entry,
                           crash=_crash_rows)
    result.seconds = time.perf_counter() - start
    order = {(op, cases.entry_id(entry)): i for i, (op, entry) in enumerate(jobs)}
    result.rows.sort(key=lambda r: (order.get((r.op, r.entry), len(order)), dtypes.index(r.dtype),
                                    ALL_CHECKS.index(r.check)))
    return result


def totals(rows: Sequence[ConformanceRow]) -> dict[str, Any]:
    """The counts over all rows, per check and overall; and the rows that break the invariant."""
    per_check = {}
    for check in ALL_CHECKS:
        here = [r for r in rows if r.check == check]
        if here:
            per_check[check] = {key: sum(getattr(r, key) for r in here)
                                for key in ("cases", "native_passed", "use_passed", "newly_passing", "newly_failing",
                                            "degenerate_cases")}
    overall = {key: sum(c[key] for c in per_check.values())
               for key in ("cases", "native_passed", "use_passed", "newly_passing", "newly_failing",
                           "degenerate_cases")}
    return {"torch_version": torch.__version__, "ops": len({r.op for r in rows}),
            "entries": len({r.entry for r in rows}), "per_check": per_check, "overall": overall,
            "newly_failing": [r.as_dict() for r in rows if r.newly_failing]}


def format_totals(summary: dict[str, Any]) -> list[str]:
    lines = [f"{'check':22s} {'cases':>7s} {'native':>7s} {'use()':>7s} {'newly ok':>9s} {'newly bad':>9s} "
             f"{'degenerate':>10s}"]
    for check, counts in [*summary["per_check"].items(), ("all", summary["overall"])]:
        lines.append(f"{check:22s} {counts['cases']:7d} {counts['native_passed']:7d} {counts['use_passed']:7d} "
                     f"{counts['newly_passing']:9d} {counts['newly_failing']:9d} {counts['degenerate_cases']:10d}")
    overall = summary["overall"]
    lines.append(f"{summary['ops']} covered ops, {summary['entries']} op_db entries: {overall['newly_failing']} "
                 f"cases newly fail inside use(), {overall['newly_passing']} newly pass")
    for row in summary["newly_failing"][:40]:
        lines.append(f"  NEWLY FAILING {row['entry']} {row['check']} {row['dtype']} ({row['newly_failing']}): "
                     f"{row['detail'][:300]}")
    return lines
