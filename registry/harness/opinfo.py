"""Matrix entries for ops whose samples come from PyTorch's OpInfo database (``define_op(..., opinfo=...)``).

The interpreter of OpInfo cases runs them (``registry.harness.case_stacks``: ``run_stack`` under the stack,
``reference`` outside any transform, per sample), with the composite under test pinned inside ``use()``; native
runs outside ``use()``. OpInfo calls the public function (``torch.nn.functional.kl_div``), so a composite is
reached the way a user reaches it, through the dispatcher; a case where the routing kernel was never reached is
reported, not counted as a pass.

The survey's six stacks fold into four matrix stacks, the contexts the router can tell apart when the op is called:
``jacrev`` runs the forward under ``grad`` and vmaps the backward, so it is part of ``grad``'s entry; ``jacfwd`` is
``vmap(jvp)``. The batching variants are the patterns: ``input`` batches self (``self``), ``others`` the other
tensor arguments (``others``).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from registry.core import routing
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES, load
from registry.harness import case_stacks, outcomes
from registry.harness import opinfo_cases as cases
from registry.store.records import MatrixEntry

# matrix stack -> the survey stacks whose worst outcome it records
STACKS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("vmap",): ("vmap",),
    ("grad",): ("grad", "jacrev"),
    ("vmap", "grad"): ("vmap(grad)",),
    ("vmap", "jvp"): ("vmap(jvp)", "jacfwd"),
}
PATTERNS: dict[str, str] = {"self": "input", "others": "others"}  # matrix pattern -> survey batching variant
NO_PATTERN = "-"
LIMIT_SAMPLES = 2
SKIPPED_SAMPLES = 16  # samples that call none of the op's routed overloads, looked past to find limit_samples that do
CASE_TIMEOUT_S = 20.0


class OpInfoError(LookupError):
    """An op names an op_db entry that PyTorch's OpInfo database does not have."""


@functools.cache
def _database() -> dict[str, Any]:
    return {cases.entry_id(entry): entry for entry in cases.op_db()}


def entries(op: str) -> list[Any]:
    """The OpInfo entries of ``op`` (``define_op(..., opinfo=...)``)."""
    load()
    database = _database()
    missing = [name for name in OPS[op].opinfo if name not in database]
    if missing:
        raise OpInfoError(f"{op}: op_db has no entry {', '.join(missing)} (torch {torch.__version__}); fix the "
                          f"opinfo=... of its define_op in {OPS[op].family}")
    return [database[name] for name in OPS[op].opinfo]


def patterns_for(stack: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(PATTERNS) if "vmap" in stack else (NO_PATTERN,)


def check(op: str, composite: str, dtype: torch.dtype, stack: tuple[str, ...], pattern: str, *,
          limit_samples: int = LIMIT_SAMPLES, timeout_s: float = CASE_TIMEOUT_S) -> outcomes.Outcome:
    """The worst outcome of ``composite`` over ``op``'s OpInfo samples under ``stack`` and ``pattern``."""
    return check_all(op, [composite], dtype, [(stack, pattern)], limit_samples=limit_samples,
                     timeout_s=timeout_s)[composite, stack, pattern]


def check_all(op: str, composites: Sequence[str], dtype: torch.dtype,
              cells: Sequence[tuple[tuple[str, ...], str]], *, limit_samples: int = LIMIT_SAMPLES,
              timeout_s: float = CASE_TIMEOUT_S) -> dict[tuple[str, tuple[str, ...], str], outcomes.Outcome]:
    """The worst outcome of each composite over ``op``'s OpInfo samples in each (stack, pattern) cell; every case
    (and its reference, computed once) is shared by all composites and cells."""
    load()
    for stack, _ in cells:
        if stack not in STACKS:
            raise ValueError(f"{op}: OpInfo cases run under {', '.join(map(str, STACKS))}, not {stack}")
    worst: dict[tuple[str, tuple[str, ...], str], outcomes.Outcome | None] = {
        (name, stack, pattern): None for name in composites for stack, pattern in cells}
    batchings = sorted({b for _, pattern in cells
                        for b in ((PATTERNS[pattern],) if pattern != NO_PATTERN else cases.BATCHINGS)})
    judged_here = any(COMPOSITES[op][name].kind != "native" for name in composites)
    for entry in entries(op):
        if dtype not in entry.supported_dtypes("cpu"):
            continue
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(cases.SEED)
            # A sample that calls none of the op's routed overloads (narrow with an int start, where only
            # narrow.Tensor is routed) checks nothing: it does not count toward the limit, and is reported only
            # when no sample of the entry reaches the op at all.
            samples = cases.pick_samples(entry, dtype, limit_samples + (SKIPPED_SAMPLES if judged_here else 0))
            checked = 0
            unreached: dict[tuple[str, tuple[str, ...], str], outcomes.Outcome] | None = None
            for index, sample in enumerate(samples):
                if checked >= limit_samples:
                    break
                found, reached = _sample_outcomes(op, composites, cells, batchings, entry, sample, index, dtype,
                                                  timeout_s)
                if not found:
                    continue
                if reached or not judged_here:
                    checked += 1
                    for key, outcome in found.items():
                        worst[key] = outcomes.worse_outcome(worst[key], outcome)
                elif unreached is None:
                    unreached = found
            if checked == 0 and unreached is not None:
                for key, outcome in unreached.items():
                    worst[key] = outcomes.worse_outcome(worst[key], outcome)
    nothing = outcomes.Outcome("unsupported", f"no OpInfo sample of {op} in {str(dtype).removeprefix('torch.')}")
    return {key: outcome or nothing for key, outcome in worst.items()}


def _sample_outcomes(op: str, composites: Sequence[str], cells: Sequence[tuple[tuple[str, ...], str]],
                     batchings: Sequence[str], entry: Any, sample: Any, index: int, dtype: torch.dtype,
                     timeout_s: float) -> tuple[dict[tuple[str, tuple[str, ...], str], outcomes.Outcome], bool]:
    """(the worst outcome per (composite, stack, pattern) on one sample, whether a pinned composite ran on it)."""
    name = cases.entry_id(entry)
    found: dict[tuple[str, tuple[str, ...], str], outcomes.Outcome] = {}
    reached = False
    random = cases.sample_is_random(entry, sample)
    for batching in batchings:
        wanted = [(stack, pattern) for stack, pattern in cells
                  if pattern == NO_PATTERN or PATTERNS[pattern] == batching]
        case = cases.prepare_case(entry, sample, batching, cases.DEFAULT_BATCH, random)
        if isinstance(case, outcomes.Outcome):  # OpInfo's sample cannot be varied per sample: nothing to check
            for key in [(c, s, p) for c in composites for s, p in wanted]:
                found[key] = outcomes.worse_outcome(found.get(key), case)
            continue
        reference = case_stacks.Reference(case)
        for stack, pattern in wanted:
            for survey_stack in STACKS[stack]:
                for composite in composites:
                    outcome, ran = _one(op, composite, case, reference, survey_stack, dtype, timeout_s)
                    reached = reached or ran
                    if outcome.status != "ok" and outcome.detail:
                        outcome = outcomes.Outcome(outcome.status, f"{name} #{index} {batching} {survey_stack}: "
                                                 f"{outcome.detail}", outcome.max_abs_error, outcome.max_rel_error)
                    key = (composite, stack, pattern)
                    found[key] = outcomes.worse_outcome(found.get(key), outcome)
    return found, reached


def _one(op: str, composite: str, case: cases.SurveyCase, reference: Any, survey_stack: str, dtype: torch.dtype,
         timeout_s: float) -> tuple[outcomes.Outcome, bool]:
    """One case under one survey stack: native outside ``use()``, another composite pinned inside it; and whether
    the routing kernel of ``op`` ran."""
    native = COMPOSITES[op][composite].kind == "native"
    # Recorded around the case, routing nothing itself: the case's own use(pins=...) records into it. Native runs
    # outside use(), where no kernel routes.
    with contextlib.nullcontext() if native else routing.use(policy="native", record=True) as recording:
        outcome = case_stacks.dynamic_outcome(case, survey_stack, case_stacks.check_case(
            survey_stack, case, reference, dtype, inside_use=not native, timeout_s=timeout_s, pins={op: composite}))
    ran = not native and any(recording.calls.get(overload.name, 0) for overload in OPS[op].overloads)
    if not native and outcome.status in ("ok", "slow") and not ran:
        # The pinned composite never ran: its pass would be native's. Said, not counted.
        return outcomes.Outcome("unsupported", f"the case never reached aten::{op} under {survey_stack}"), ran
    return outcome, ran


def matrix_entries(op: str, dtype: str, composites: Sequence[str], cells: Sequence[tuple[tuple[str, ...], str]],
                   source_hashes: dict[str, str]) -> list[MatrixEntry]:
    found = check_all(op, composites, getattr(torch, dtype), cells)
    measured_at = time.time()
    return [MatrixEntry(
        op=op, composite=name, kind=COMPOSITES[op][name].kind, stack=stack, pattern=pattern, dtype=dtype,
        status=outcome.status, detail=outcome.detail[:500], max_abs_error=outcome.max_abs_error,
        max_rel_error=outcome.max_rel_error, source_hash=source_hashes[name], torch_version=torch.__version__,
        device="cpu", measured_at=measured_at) for (name, stack, pattern), outcome in found.items()]
