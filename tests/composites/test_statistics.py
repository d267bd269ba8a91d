"""bincount under vmap (composites/statistics.py): one scatter_add into zeros of the length every sample shares, where
PyTorch 2.13 loops over the batch (no batching rule), and a clear error where the samples' lengths would differ."""

from __future__ import annotations

import pytest
import torch
from torch import func

import registry
from registry.core.batch_split import BatchSplitWarning, SplitShapeError
from registry.harness import fallback
from tests.composites.test_reduce import no_vmap_fallback

CLASSES = 3
TARGETS = torch.tensor([[0, 1, 2, 2, 1, 0], [2, 2, 2, 0, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
PREDICTIONS = torch.tensor([[0, 2, 2, 1, 1, 0], [2, 0, 2, 0, 1, 1], [1, 1, 0, 1, 2, 1], [0, 0, 1, 0, 0, 0]])


def confusion(target: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
    """A metric library's confusion matrix: bincount of target * n + prediction, minlength n * n."""
    return torch.bincount(target * CLASSES + prediction, minlength=CLASSES * CLASSES).reshape(CLASSES, CLASSES)


def _loop(fn, *batched: torch.Tensor) -> torch.Tensor:
    return torch.stack([fn(*values) for values in zip(*batched, strict=True)])


def test_confusion_matrix_under_vmap_equals_the_loop() -> None:
    expected = _loop(confusion, TARGETS, PREDICTIONS)
    with fallback.watch() as caught:  # the warning switched on, whatever an earlier test left
        torch.testing.assert_close(func.vmap(confusion)(TARGETS, PREDICTIONS), expected)  # native: a loop
    assert fallback.fallback_note(caught) is not None
    with registry.use(), no_vmap_fallback():
        got = func.vmap(confusion)(TARGETS, PREDICTIONS)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


WEIGHTS = torch.tensor([[0.5, 1.0, 2.0, 0.25], [1.5, -1.0, 0.5, 2.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
VALUES = torch.tensor([[0, 3, 3, 1], [3, 2, 2, 0], [1, 0, 3, 3]])  # every sample's largest value is 3


@pytest.mark.parametrize("minlength", [0, 4, 7])
def test_weights_and_minlength_under_vmap_equal_the_loop(minlength: int) -> None:
    def weighted(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.bincount(values, weights=weights, minlength=minlength)

    expected = _loop(weighted, VALUES, WEIGHTS)
    with registry.use(), no_vmap_fallback():
        got = func.vmap(weighted)(VALUES, WEIGHTS)
        shared_values = func.vmap(weighted, in_dims=(None, 0))(VALUES[0], WEIGHTS)
        integer_weights = func.vmap(weighted)(VALUES, WEIGHTS.long())
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    assert torch.equal(shared_values, _loop(lambda w: weighted(VALUES[0], w), WEIGHTS))
    assert integer_weights.dtype == torch.float64
    assert torch.equal(integer_weights, _loop(weighted, VALUES, WEIGHTS.long()))


def test_nested_vmaps_share_one_length() -> None:
    values = torch.stack([VALUES, VALUES.flip(1)])
    expected = torch.stack([_loop(torch.bincount, v) for v in values])
    with registry.use(), no_vmap_fallback():
        assert torch.equal(func.vmap(func.vmap(torch.bincount))(values), expected)


def test_lengths_that_differ_to_the_end_name_minlength() -> None:
    values = torch.tensor([[0, 1], [0, 4]])  # lengths 2 and 5: the batch splits, and the results keep their lengths
    with registry.use(), pytest.warns(BatchSplitWarning), pytest.raises(SplitShapeError) as raised:
        func.vmap(torch.bincount)(values)
    assert "the samples' counts would have different lengths" in str(raised.value)
    assert "pass minlength=5 or more" in str(raised.value)
    with registry.use():
        assert torch.equal(func.vmap(lambda v: torch.bincount(v, minlength=5))(values),
                           _loop(lambda v: torch.bincount(v, minlength=5), values))


def test_lengths_that_differ_then_agree_again_split_and_equal_the_loop() -> None:
    """A weighted count reduced per sample: the lengths differ (2, 5, 2), the samples split into groups of agreeing
    lengths, and the per-sample results stack again in the original order."""
    values = torch.tensor([[0, 1], [0, 4], [1, 1]])
    weights = torch.tensor([[0.5, 2.0], [1.5, -1.0], [3.0, 0.25]], dtype=torch.float64)

    def weighted_moment(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(v, weights=w)
        return (counts * torch.arange(counts.shape[0], dtype=counts.dtype)).sum()

    expected = _loop(weighted_moment, values, weights)
    with registry.use(), pytest.warns(BatchSplitWarning, match="split into 2 groups"):
        got = func.vmap(weighted_moment)(values, weights)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_what_native_refuses_is_refused() -> None:
    with registry.use():
        with pytest.raises(RuntimeError, match="bincount only supports 1-d non-negative integral inputs"):
            func.vmap(torch.bincount)(torch.tensor([[0, -1], [1, 2]]))
        with pytest.raises(RuntimeError, match="weights should be 1-d and have the same length as input"):
            func.vmap(lambda v: torch.bincount(v, weights=torch.ones(3)))(VALUES)


def test_empty_samples_have_minlength_counts() -> None:
    with registry.use(), no_vmap_fallback():
        got = func.vmap(lambda v: torch.bincount(v, minlength=3))(torch.zeros(2, 0, dtype=torch.int64))
    assert torch.equal(got, torch.zeros(2, 3, dtype=torch.int64))
