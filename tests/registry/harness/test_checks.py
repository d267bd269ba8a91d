"""The harness itself must be able to fail: wrong answers, vmap-hostile code and per-sample loops are caught."""

from __future__ import annotations

import torch

from registry.harness.checks import check, entry_call
from registry.harness.samples import SAMPLES

MASKED_FILL = next(s for s in SAMPLES["masked_fill"] if s.name == "scalar" and s.dtype == torch.float64)


def _composite_call(fn):
    def call(args):
        return fn(*args.values())

    return call


def test_ok_for_a_correct_composite() -> None:
    call = _composite_call(lambda self, mask, value: torch.where(mask, value, self))
    assert check(MASKED_FILL, "vmap(grad)", "self", call).status == "ok"


def test_mismatch_for_a_wrong_composite() -> None:
    call = _composite_call(lambda self, mask, value: torch.where(mask, value + 1e-3, self))
    outcome = check(MASKED_FILL, "vmap", "self", call)
    assert outcome.status == "mismatch"
    assert outcome.detail.startswith("output: max abs error 0.001")


def test_error_for_vmap_hostile_code() -> None:
    call = _composite_call(lambda self, mask, value: self if bool(mask.any()) else self * 2)
    outcome = check(MASKED_FILL, "vmap", "others", call)
    assert outcome.status == "error"
    assert "data-dependent" in outcome.detail or "item" in outcome.detail


def test_slow_for_a_per_sample_loop() -> None:
    sample = next(s for s in SAMPLES["masked_scatter"] if s.name == "same-shape" and s.dtype == torch.float64)
    outcome = check(sample, "vmap", "self", entry_call("masked_scatter", sample))
    assert outcome.status == "slow"
    assert "aten::masked_scatter" in outcome.detail
