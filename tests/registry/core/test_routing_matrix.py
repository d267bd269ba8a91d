"""Inside use(), the seed ops called through their public entry point pass every stack of the verified matrix.

The matrix (registry.harness.verify) judges each composite called directly; this runs the same generated stacks
(depth 1 to 3 over vmap, grad, jvp, and functionalize / compile around depth 1 and 2) and batching patterns on the
op as a user calls it, routed at the dispatcher, against the per-sample loop of native PyTorch. One float64 sample
per op and pattern; tests/composites/test_stacks.py covers every sample and float32.
"""

from __future__ import annotations

import pytest
import torch

import registry
from registry.harness.checks import entry_call
from registry.harness.samples import SAMPLES
from registry.harness.verify import (
    PATTERNS,
    _patterns_for,  # noqa: PLC2701 - a test of the module's own helper
    check_stack,
    default_stacks,
)
from tests import cases

pytestmark = pytest.mark.usefixtures("routing_backend")
STACKS = cases.matrix_stacks(default_stacks())  # compile around all but vmap: make test-all (tests/cases.py)


def _first_sample(op: str):
    return next(s for s in SAMPLES[op] if s.dtype == torch.float64 and s.differentiable)


@pytest.mark.parametrize("op", list(SAMPLES))
def test_every_matrix_stack_inside_use(op: str) -> None:
    sample = _first_sample(op)
    failures = []
    for stack in STACKS:
        for pattern in _patterns_for(sample, stack, PATTERNS):
            with registry.use():
                status, detail, _, _ = check_stack(sample, stack, pattern, entry_call(op, sample))
            if status not in ("ok", "unsupported"):
                failures.append(f"{','.join(stack)} {pattern}: {status} {detail}")
            if status == "unsupported":
                assert detail.startswith("reference:") is False, f"{stack} {pattern}: {detail}"
    assert failures == []
    if "compile" in {t for s in STACKS for t in s}:
        torch._dynamo.reset()
