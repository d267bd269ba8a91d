"""Inside ``registry.use()``, every seed op under every transform stack and batching pattern matches a Python loop
over the batch calling native PyTorch outside any transform, with no vmap fallback warning.

The same harness, pointed at native PyTorch outside ``use()``, finds the errors, slow loops and wrong answers that
the rules route around: the last tests keep that evidence honest."""

from __future__ import annotations

import pytest
import torch

import registry
from registry.core import rules
from registry.core.context import Context
from registry.harness.checks import PATTERNS, STACKS, check, entry_call, skip_reason
from registry.harness.samples import SAMPLES

FAST_STACKS = [stack for stack in STACKS if stack != "compile"]


def _failures(op: str, stack: str, dtypes: tuple[torch.dtype, ...] | None = None) -> list[str]:
    failures = []
    for sample in SAMPLES[op]:
        if dtypes is not None and sample.dtype not in dtypes:
            continue
        for pattern in PATTERNS:
            if skip_reason(sample, stack, pattern):
                continue
            with registry.use():
                outcome = check(sample, stack, pattern)
            if outcome.status != "ok":
                failures.append(f"{sample.id} {stack} {pattern}: {outcome.status} {outcome.detail}")
    return failures


@pytest.mark.parametrize("stack", FAST_STACKS)
@pytest.mark.parametrize("op", list(SAMPLES))
def test_op_under_stack_inside_use(op: str, stack: str) -> None:
    assert _failures(op, stack) == []


@pytest.mark.parametrize("op", list(SAMPLES))
def test_op_under_compile_inside_use(op: str) -> None:
    """torch.compile(vmap(f), backend="aot_eager", fullgraph=True): one dtype, every pattern (compiling is slow)."""
    assert _failures(op, "compile", dtypes=(torch.float64,)) == []


def _native_outcomes(op: str) -> dict[str, set[str]]:
    statuses: dict[str, set[str]] = {}
    for sample in SAMPLES[op]:
        for stack in FAST_STACKS:
            for pattern in PATTERNS:
                if skip_reason(sample, stack, pattern):
                    continue
                outcome = check(sample, stack, pattern, entry_call(op, sample), count_loops=True)  # outside use()
                statuses.setdefault(outcome.status, set()).add(f"{sample.name} {stack} {pattern}")
    return statuses


@pytest.mark.parametrize("op", list(SAMPLES))
def test_rules_match_native_evidence(op: str) -> None:
    """Native is routed around only where it measurably fails, and measured failures are all routed around."""
    outcomes = _native_outcomes(op)
    failing = {status: cases for status, cases in outcomes.items() if status != "ok"}
    # Every other argument set (Context.given): contiguous and to fail under vmap only with a memory_format.
    others = tuple(name for name in registry.OPS[op].params if name not in registry.OPS[op].tensor_args)
    tensors = registry.OPS[op].tensor_args
    stacks_with_vmap = Context(stack=("vmap",), tensors=tensors, batched=tensors, given=others)
    if rules.problem(op, "native", stacks_with_vmap) is None:
        assert failing == {}, f"native {op} fails somewhere the rules do not know of"
    else:
        assert failing, f"the rules route around native {op}, but native passed everywhere"


def test_native_pytorch_failures_that_use_fixes() -> None:
    """Concrete cases where PyTorch 2.13 itself raises, loops, or is wrong, and use() is right."""
    samples = {sample.id: sample for op in SAMPLES for sample in SAMPLES[op]}
    cases = [
        ("masked_scatter-same-shape-float32", "vmap(grad)", "self", "slow"),
        ("index_fill-tensor-negdim-float32", "vmap", "others", "mismatch"),
        ("index_fill-scalar-repeated-float64", "vmap(jacfwd)", "others", "error"),
        ("to-channels-last-float64", "vmap", "self", "error"),
        ("index_fill-negative-index-float64", "grad", "self", "error"),
    ]
    for sample_id, stack, pattern, native_status in cases:
        sample = samples[sample_id]
        assert check(sample, stack, pattern, entry_call(sample.op, sample)).status == native_status
        with registry.use():
            assert check(sample, stack, pattern).status == "ok"
