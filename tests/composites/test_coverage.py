"""Every op whose samples come from OpInfo (``define_op(..., opinfo=...)``), checked the way the survey checks it.

1. Each composite other than native, pinned inside ``use()``, under the four matrix stacks and both batching
   variants: values, gradients, Jacobians and tangents equal a per-sample loop of native PyTorch outside any
   transform, with no fallback to vmap's per-sample loop. ``unsupported`` is accepted only where the reference
   itself cannot be computed or the case has nothing to batch or differentiate (the same for every composite).
2. Each op's op_db entries inside ``use()`` with the default policy: no slow, error or mismatch case under the
   survey's six stacks, and nothing worse than native.

The fast subset here runs float32 and one OpInfo sample per entry (``COVERAGE_TEST_SAMPLES`` raises it, and
``COVERAGE_TEST_DTYPES=float32,float64`` adds float64); ``multicomposite verify`` runs two samples and both dtypes.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import registry
from registry.core.context import Context
from registry.core.kinds import KIND
from registry.harness import opinfo, survey
from registry.harness.samples import SAMPLES

SAMPLES_PER_ENTRY = int(os.environ.get("COVERAGE_TEST_SAMPLES", "1"))
DTYPES = tuple(os.environ.get("COVERAGE_TEST_DTYPES", "float32").split(","))

OPINFO_OPS = [name for name, op in registry.OPS.items() if op.opinfo and name not in SAMPLES]

# The reasons a case cannot be checked at all: they do not depend on the composite.
_NOTHING_TO_CHECK = ("no floating tensor to differentiate", "no tensor among the arguments",
                     "reference (native, no transform) fails", "op does not support", "no floating output",
                     "random op", "dynamic shape op", "no OpInfo sample", "cannot build per-sample arguments",
                     "value there unspecified", "native's gradient for self is wrong")


def _cells() -> list[tuple[str, str, tuple[str, ...], str, str]]:
    """Every non-native composite under every matrix stack where its kind as such is valid (a custom_op's kind rule
    excludes the stacks that differentiate: tests/composites/test_custom_op.py checks that rule's claim)."""
    cells = []
    for op in OPINFO_OPS:
        for name, composite in registry.COMPOSITES[op].items():
            if composite.kind == "native":
                continue
            kind_rule = KIND[composite.kind].rule
            for stack in opinfo.STACKS:
                if kind_rule is not None and kind_rule(Context(stack=stack)) is not None:
                    continue
                for pattern in opinfo.patterns_for(stack):
                    for dtype in DTYPES:
                        cells.append((op, name, stack, pattern, dtype))
    return cells


@functools.cache
def _outcomes(op: str, dtype: str) -> dict[tuple[str, tuple[str, ...], str], survey.Outcome]:
    """Every cell of ``op`` at ``dtype``, computed together: each OpInfo case and its reference once, shared by the
    composites and stacks (the test of each cell reads its own outcome)."""
    names = [name for name, c in registry.COMPOSITES[op].items() if c.kind != "native"]
    cells = [(stack, pattern) for stack in opinfo.STACKS for pattern in opinfo.patterns_for(stack)]
    return opinfo.check_all(op, names, getattr(torch, dtype), cells, limit_samples=SAMPLES_PER_ENTRY)


@pytest.mark.parametrize(("op", "composite", "stack", "pattern", "dtype"), _cells(),
                         ids=lambda v: registry.format_stack(v) if isinstance(v, tuple) else str(v))
def test_composite_matches_native_loop(op: str, composite: str, stack: tuple[str, ...], pattern: str,
                                       dtype: str) -> None:
    outcome = _outcomes(op, dtype)[composite, stack, pattern]
    if outcome.status == "unsupported":
        assert any(reason in outcome.detail for reason in _NOTHING_TO_CHECK), outcome.detail
    else:
        assert outcome.status == "ok", outcome.detail


def test_every_opinfo_op_has_a_composite_besides_native() -> None:
    lacking = [op for op in OPINFO_OPS if set(c.kind for c in registry.COMPOSITES[op].values()) == {"native"}]
    assert lacking == []


@pytest.mark.parametrize("op", OPINFO_OPS)
def test_survey_inside_use_fixes_native(op: str) -> None:
    config = survey.SurveyConfig(limit_samples=SAMPLES_PER_ENTRY)
    worse, left = [], []
    for entry in opinfo.entries(op):
        for dtype in DTYPES:
            for row in survey.survey_entry(entry, dtype, config):
                where = f"{row.op} {row.stack} {row.batching} {row.dtype}"
                if survey.RANK.index(row.use_status) > max(survey.RANK.index(row.native_status),
                                                           survey.RANK.index("ok")):
                    worse.append(f"{where}: native {row.native_status}, inside use() {row.use_status}: "
                                 f"{row.use_detail}")
                elif row.use_status in survey.MISBEHAVING:
                    left.append(f"{where}: {row.use_status}: {row.use_detail}")
    assert worse == []
    assert left == []
