"""Matrix entries for ops whose samples come from PyTorch's OpInfo database (``define_op(..., opinfo=...)``).

The survey's interpreter runs them (``registry.harness.survey``: ``run_stack`` under torch.func, ``reference``
outside any transform, per sample), with the composite under test pinned inside ``use()``; native runs outside
``use()``. OpInfo calls the public function (``torch.nn.functional.kl_div``), so a composite is reached the way a
user reaches it, through the dispatcher; a case where the routing kernel was never reached is reported, not counted
as a pass.

The survey's six stacks fold into four matrix stacks, the contexts the router can tell apart when the op is called:
``jacrev`` runs the forward under ``grad`` and vmaps the backward, so it is part of ``grad``'s entry; ``jacfwd`` is
``vmap(jvp)``. The batching variants are the patterns: ``input`` batches self (``self``), ``others`` the other
tensor arguments (``others``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from registry.core import routing
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES
from registry.harness import survey
from registry.store.db import MatrixEntry

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
SKIPPED_SAMPLES = 8  # samples that call none of the op's routed overloads, looked past to find limit_samples that do
CASE_TIMEOUT_S = 20.0


class OpInfoError(LookupError):
    """An op names an op_db entry that PyTorch's OpInfo database does not have."""


@functools.cache
def _database() -> dict[str, Any]:
    return {survey.entry_id(entry): entry for entry in survey.op_db()}


def entries(op: str) -> list[Any]:
    """The OpInfo entries of ``op`` (``define_op(..., opinfo=...)``)."""
    database = _database()
    missing = [name for name in OPS[op].opinfo if name not in database]
    if missing:
        raise OpInfoError(f"{op}: op_db has no entry {', '.join(missing)} (torch {torch.__version__}); fix the "
                          f"opinfo=... of its define_op in {OPS[op].family}")
    return [database[name] for name in OPS[op].opinfo]


def patterns_for(stack: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(PATTERNS) if "vmap" in stack else (NO_PATTERN,)


def _routed_calls(op: str) -> int:
    return sum(routing.KERNEL_CALLS.get(overload.name, 0) for overload in OPS[op].overloads)


def check(op: str, composite: str, dtype: torch.dtype, stack: tuple[str, ...], pattern: str, *,
          limit_samples: int = LIMIT_SAMPLES, timeout_s: float = CASE_TIMEOUT_S) -> survey.Outcome:
    """The worst outcome of ``composite`` over ``op``'s OpInfo samples under ``stack`` and ``pattern``."""
    if stack not in STACKS:
        raise ValueError(f"{op}: OpInfo cases run under {', '.join(map(str, STACKS))}, not {stack}")
    kind = COMPOSITES[op][composite].kind
    batchings = (PATTERNS[pattern],) if pattern != NO_PATTERN else survey.BATCHINGS
    worst: survey.Outcome | None = None
    for entry in entries(op):
        name = survey.entry_id(entry)
        if dtype not in entry.supported_dtypes("cpu"):
            continue
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(survey.SEED)
            # A sample that calls none of the op's routed overloads (narrow with an int start, where only
            # narrow.Tensor is routed) checks nothing: it does not count toward the limit, and is reported only when
            # no sample reaches the op at all.
            samples = survey.pick_samples(entry, dtype, limit_samples + (SKIPPED_SAMPLES if kind != "native" else 0))
            checked = 0
            unreached: survey.Outcome | None = None
            for index, sample in enumerate(samples):
                if checked >= limit_samples:
                    break
                sample_worst: survey.Outcome | None = None
                reached = kind == "native"
                for batching in batchings:
                    try:
                        case = survey.SurveyCase(entry, sample, batching, survey.DEFAULT_BATCH)
                    except Exception as error:  # OpInfo's sample cannot be varied per sample: nothing to check
                        outcome = survey.Outcome("unsupported", f"cannot build per-sample arguments: {error}")
                        sample_worst = survey._worse(sample_worst, outcome)
                        continue
                    case.random = survey._is_random(entry, sample)
                    case.dynamic = survey._is_dynamic(entry, sample, case.batched)
                    reference = survey._Reference(case)
                    for survey_stack in STACKS[stack]:
                        before = _routed_calls(op)
                        outcome = survey._dynamic(case, survey_stack, survey.check_case(
                            survey_stack, case, reference, dtype, inside_use=kind != "native", timeout_s=timeout_s,
                            pins={op: composite}))
                        if _routed_calls(op) != before:
                            reached = True
                        elif kind != "native" and outcome.status in ("ok", "slow"):
                            outcome = survey.Outcome(
                                "unsupported", f"{name} sample {index} never reached aten::{op} under {survey_stack}")
                        if outcome.status != "ok" and outcome.detail:
                            outcome = survey.Outcome(outcome.status,
                                                     f"{name} #{index} {batching} {survey_stack}: {outcome.detail}",
                                                     outcome.max_abs_error, outcome.max_rel_error)
                        sample_worst = survey._worse(sample_worst, outcome)
                if sample_worst is None:
                    continue
                if reached:
                    checked += 1
                    worst = survey._worse(worst, sample_worst)
                elif unreached is None:
                    unreached = sample_worst
            if checked == 0 and unreached is not None:
                worst = survey._worse(worst, unreached)
    return worst or survey.Outcome("unsupported", f"no OpInfo sample of {op} in {str(dtype).removeprefix('torch.')}")


def matrix_entry(op: str, composite: str, dtype: str, stack: tuple[str, ...], pattern: str, source_hash: str,
                 ) -> MatrixEntry:
    outcome = check(op, composite, getattr(torch, dtype), stack, pattern)
    return MatrixEntry(
        op=op, composite=composite, kind=COMPOSITES[op][composite].kind, stack=stack, pattern=pattern, dtype=dtype,
        status=outcome.status, detail=outcome.detail[:500], max_abs_error=outcome.max_abs_error,
        max_rel_error=outcome.max_rel_error, source_hash=source_hash, torch_version=torch.__version__, device="cpu",
    )
