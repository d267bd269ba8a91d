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


INDEX_ADD = next(s for s in SAMPLES["index_add"] if s.name == "dim0-repeated" and s.dtype == torch.float64)


def test_slow_for_a_loop_without_the_warning() -> None:
    """functorch's index_add rule runs index_add once per sample where the index is batched, without vmap's warning:
    counted, PyTorch's own op is slow there (3 samples: 3 calls, as the per-sample loop)."""
    outcome = check(INDEX_ADD, "vmap", "others", entry_call("index_add", INDEX_ADD), count_loops=True)
    assert outcome.status == "slow"
    assert outcome.detail == ("vmap ran aten::index_add once per sample (3 calls for 3 samples, as the per-sample "
                              "loop): its batching rule loops without vmap's warning")
    nested = check(INDEX_ADD, "vmap(vmap)", "others", entry_call("index_add", INDEX_ADD), count_loops=True)
    assert nested.status == "slow"
    assert "(6 calls for 6 samples" in nested.detail


def test_ok_where_the_batching_rule_batches() -> None:
    """Only self batched, index_add's rule makes one call: counting finds no loop; without counting, none is
    looked for."""
    assert check(INDEX_ADD, "vmap", "self", entry_call("index_add", INDEX_ADD), count_loops=True).status == "ok"
    assert check(INDEX_ADD, "vmap", "others", entry_call("index_add", INDEX_ADD)).status == "ok"
