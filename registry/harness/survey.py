"""The survey: every OpInfo entry of PyTorch's ``op_db`` under the matrix's transform stacks, natively and inside
``registry.use()``, against a per-sample loop of native PyTorch outside any transform.

It measures coverage and finds what to cover next. One case is one OpInfo sample, one batching variant, one dtype
and one stack (``registry.harness.opinfo_cases``); the interpreter of cases (``registry.harness.case_stacks``) runs
it under the stack and classifies it against the reference; a row is the worst outcome over an entry's samples
(``registry.harness.outcomes``). Many entries run in forked workers (``registry.harness.fork_pool``), each case under
a deadline (``registry.harness.deadline``); ``registry.harness.survey_summary`` says what was found.

This module runs the survey; the names of those modules that callers use are importable from here too.
"""

from __future__ import annotations

import datetime
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from registry.core.messages import described
from registry.core.stacks import canonical_workload
from registry.core.status import RANK
from registry.harness.case_stacks import (
    INTERPRETER_STACKS,
    MORE_STACKS,
    RANDOM_UNDER_VMAP,
    SURVEY_STACKS,
    Reference,
    check_case,
    compare,
    dynamic_outcome,
    project_jacobian,
    reference,
    run_stack,
)
from registry.harness.deadline import DEFAULT_CASE_TIMEOUT_S, deadline
from registry.harness.fork_pool import run_forked
from registry.harness.opinfo_cases import (
    ALL_SAMPLES,
    BATCHINGS,
    DEFAULT_BATCH,
    DEPTH3_STACKS,
    DTYPES,
    JACOBIAN_DIRECTIONS,
    ORDERED_ARGUMENTS,
    SEED,
    SIZE_CAP,
    UNINITIALIZED,
    SurveyCase,
    SurveyError,
    entry_id,
    is_dynamic,
    live_callable,
    op_db,
    pick_samples,
    prepare_case,
    repeated_unpool_indices,
    sample_is_random,
    select_entries,
    static_reason,
)
from registry.harness.outcomes import MISBEHAVING, Outcome, worse_outcome
from registry.harness.survey_rows import SurveyRow
from registry.harness.survey_summary import format_rows, format_summary, summarize

__all__ = [
    "ALL_SAMPLES", "BATCHINGS", "DEFAULT_BATCH", "DEFAULT_CASE_TIMEOUT_S", "DEFAULT_LIMIT_SAMPLES",
    "DEPTH3_STACKS", "DTYPES", "INTERPRETER_STACKS", "JACOBIAN_DIRECTIONS", "MISBEHAVING", "MORE_STACKS",
    "ORDERED_ARGUMENTS",
    "RANDOM_UNDER_VMAP", "RANK", "SEED", "SIZE_CAP", "SURVEY_STACKS", "UNINITIALIZED", "Outcome", "Reference",
    "SurveyCase", "SurveyConfig", "SurveyError", "SurveyRow", "SurveyRun", "check_case", "compare",
    "dynamic_outcome", "entry_id", "format_rows", "format_summary", "is_dynamic", "live_callable",
    "normalize_stack", "op_db", "pick_samples", "prepare_case", "project_jacobian", "reference",
    "repeated_unpool_indices", "run_forked", "run_stack", "run_survey", "sample_is_random", "select_entries",
    "static_reason", "summarize", "survey_entry", "worse_outcome",
]

# 25 OpInfo samples per entry and dtype (of at most SIZE_CAP elements): the three silent wrong answers of torch 2.13
# the survey finds show at samples 6 (linalg.pinv) and 17 (roll, cdist), none within 2; 25 samples took 2.5 times
# as long as 2 (docs/verification.md, Survey: the sample cap).
DEFAULT_LIMIT_SAMPLES = 25


@dataclass
class SurveyConfig:
    stacks: tuple[str, ...] = SURVEY_STACKS
    batchings: tuple[str, ...] = BATCHINGS
    limit_samples: int = DEFAULT_LIMIT_SAMPLES
    batch: int = DEFAULT_BATCH
    case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S
    inside_use: bool = True


def normalize_stack(text: str) -> str:
    """``vmap(grad)`` or ``vmap,grad`` to the survey's spelling; raises SurveyError naming the valid stacks."""
    try:
        stack = canonical_workload(text)  # the one spelling, aliases kept as written (jacrev is a survey stack)
    except ValueError:
        stack = text
    if stack not in SURVEY_STACKS + DEPTH3_STACKS:
        raise SurveyError(f"unknown survey stack {text!r}; valid: {', '.join(SURVEY_STACKS + DEPTH3_STACKS)}")
    return stack


def survey_entry(opinfo: Any, dtype_name: str, config: SurveyConfig) -> list[SurveyRow]:
    """Every (stack, batching) row of one op_db entry at one dtype."""
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")  # deprecation chatter of the ops themselves; vmap's warnings are caught inside
        # OpInfo draws its samples from the global generator: seeded, an entry's rows depend on nothing else.
        torch.manual_seed(SEED)
        return _survey_entry(opinfo, dtype_name, config)


def _survey_entry(opinfo: Any, dtype_name: str, config: SurveyConfig) -> list[SurveyRow]:
    dtype = getattr(torch, dtype_name)
    name = entry_id(opinfo)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def row(stack: str, batching: str, native: Outcome, used: Outcome, samples: int) -> SurveyRow:
        return SurveyRow(op=name, opinfo_name=opinfo.name, variant_test_name=opinfo.variant_test_name, stack=stack,
                         batching=batching, dtype=dtype_name, native_status=native.status,
                         native_detail=native.detail, use_status=used.status, use_detail=used.detail,
                         max_abs_error=native.max_abs_error, max_rel_error=native.max_rel_error, samples=samples,
                         torch_version=torch.__version__, timestamp=stamp)

    def every_row(outcome: Outcome) -> list[SurveyRow]:
        return [row(s, b, outcome, outcome, 0) for s in config.stacks for b in config.batchings]

    if dtype not in opinfo.supported_dtypes("cpu"):
        return every_row(Outcome("unsupported", f"op does not support {dtype_name} on CPU"))
    try:
        with deadline(config.case_timeout_s):
            samples = pick_samples(opinfo, dtype, config.limit_samples)
    except Exception as error:  # OpInfo's own generator failing is reported, not raised
        return every_row(Outcome("unsupported", f"OpInfo's sample_inputs fails: {described(error)}"))
    if not samples:
        return every_row(Outcome("unsupported", "OpInfo has no sample input"))
    randomness = {index: sample_is_random(opinfo, sample) for index, sample in enumerate(samples)}
    rows = []
    for batching in config.batchings:
        worst: dict[str, tuple[Outcome | None, Outcome | None, int]] = {s: (None, None, 0) for s in config.stacks}
        for index, sample in enumerate(samples):
            case = prepare_case(opinfo, sample, batching, config.batch, randomness[index])
            if isinstance(case, Outcome):
                for stack in config.stacks:
                    native, used, count = worst[stack]
                    worst[stack] = (worse_outcome(native, case), worse_outcome(used, case), count)
                continue
            ref = Reference(case)
            for stack in config.stacks:
                native_outcome = dynamic_outcome(case, stack, check_case(stack, case, ref, dtype, inside_use=False,
                                                                  timeout_s=config.case_timeout_s))
                used_outcome = (dynamic_outcome(case, stack, check_case(stack, case, ref, dtype, inside_use=True,
                                                                 timeout_s=config.case_timeout_s))
                                if config.inside_use else Outcome("unsupported", "not run inside use()"))
                native, used, count = worst[stack]
                checked = native_outcome.status != "unsupported"
                worst[stack] = (worse_outcome(native, native_outcome), worse_outcome(used, used_outcome),
                                count + checked)
        for stack in config.stacks:
            native, used, count = worst[stack]
            rows.append(row(stack, batching, native or Outcome("unsupported"), used or Outcome("unsupported"), count))
    return rows


# --- many entries: in process, or in forked workers --------------------------------------------------------------


def _crash_rows(opinfo: Any, dtype_name: str, config: SurveyConfig, why: str) -> list[SurveyRow]:
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return [SurveyRow(op=entry_id(opinfo), opinfo_name=opinfo.name, variant_test_name=opinfo.variant_test_name,
                      stack=s, batching=b, dtype=dtype_name, native_status="error", native_detail=why,
                      use_status="error", use_detail=why, max_abs_error=None, max_rel_error=None, samples=0,
                      torch_version=torch.__version__, timestamp=stamp)
            for s in config.stacks for b in config.batchings]


@dataclass
class SurveyRun:
    rows: list[SurveyRow] = field(default_factory=list)
    seconds: float = 0.0
    entries: int = 0


def run_survey(entries: Sequence[Any], dtypes: Sequence[str], config: SurveyConfig, *, workers: int = 0,
               job_timeout_s: float = 600.0,
               on_rows: Callable[[list[SurveyRow], int, int], None] | None = None) -> SurveyRun:
    """Survey ``entries`` at ``dtypes``; ``workers`` > 0 forks that many processes (a crashed or hung job becomes
    error rows, the survey goes on). ``on_rows(rows, done, total)`` sees each finished (entry, dtype) job."""
    for dtype_name in dtypes:
        if dtype_name not in DTYPES:
            raise SurveyError(f"unknown survey dtype {dtype_name!r}; valid: {', '.join(DTYPES)}")
    jobs = [(index, dtype_name) for index in range(len(entries)) for dtype_name in dtypes]
    result = SurveyRun(entries=len(entries))
    start = time.perf_counter()

    def finished(rows: list[SurveyRow]) -> None:
        result.rows.extend(rows)
        if on_rows is not None:
            on_rows(rows, len({(r.op, r.dtype) for r in result.rows}), len(jobs))

    if workers <= 0:
        for index, dtype_name in jobs:
            finished(survey_entry(entries[index], dtype_name, config))
    else:
        run_forked(entries, jobs, config, workers, job_timeout_s, finished, work=survey_entry, crash=_crash_rows)
    result.seconds = time.perf_counter() - start
    # Workers finish in any order; rows come back in op_db's order, then dtype, batching and stack order.
    position = {entry_id(e): i for i, e in enumerate(entries)}
    result.rows.sort(key=lambda r: (position.get(r.op, len(position)), dtypes.index(r.dtype),
                                    config.batchings.index(r.batching), config.stacks.index(r.stack)))
    return result

