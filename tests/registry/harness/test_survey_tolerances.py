"""The OpInfo cases' comparison (the "derivatives" row of the one tolerance table): relative to the reference's
largest value, keyed by the compared tensor's dtype."""

from __future__ import annotations

import pytest
import torch

from registry.harness import case_stacks, comparison, survey

DERIVATIVES = comparison.TOLERANCES["derivatives"]


def test_float32_rounding_of_small_entries_is_judged_against_the_largest_value() -> None:
    expected = torch.tensor([100.0, 1e-3, -50.0])
    # 0.5 off on an entry of 1e-3: relative to that entry a disaster, relative to the largest value (100) 0.5%, the
    # size of the rounding a sum of such terms carries.
    assert survey.compare(expected + torch.tensor([0.0, 0.5, 0.0]), expected, torch.float32) is None
    wrong = survey.compare(expected + torch.tensor([0.0, 5.0, 0.0]), expected, torch.float32)
    assert wrong is not None and wrong.status == "mismatch"
    assert wrong.detail.startswith("output: max abs error 5, max rel error")
    assert wrong.max_abs_error == pytest.approx(5.0)


def test_a_zero_reference_allows_the_absolute_tolerance_only() -> None:
    zeros = torch.zeros(4)
    assert survey.compare(zeros + 5e-4, zeros, torch.float32) is None
    assert survey.compare(zeros + 5e-3, zeros, torch.float32) is not None


def test_float64_is_judged_at_its_own_tolerance() -> None:
    expected = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert survey.compare(expected + 1e-6, expected, torch.float64) is None
    assert survey.compare(expected + 1e-4, expected, torch.float64) is not None


def test_a_float32_tensor_in_a_float64_case_gets_float32_tolerance() -> None:
    # cov's float64 samples carry float32 aweights: their gradient is float32, rounded as float32 rounds.
    expected = torch.tensor([1.0, 2.0], dtype=torch.float32)
    assert survey.compare(expected + 1e-3, expected, torch.float64) is None
    assert DERIVATIVES.bounds(torch.float32) == (2e-2, 1e-3)
    assert DERIVATIVES.bounds(torch.float64) == (1e-5, 1e-6)


def test_nan_where_the_reference_is_finite_is_a_mismatch_and_integers_compare_exactly() -> None:
    outcome = survey.compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), torch.float32)
    assert outcome is not None and outcome.max_abs_error == float("inf")
    # Where the reference is not finite there is nothing to check against.
    assert survey.compare(torch.tensor([1.0, 7.0]), torch.tensor([1.0, float("nan")]), torch.float32) is None
    assert survey.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), torch.float32) is not None
    assert survey.compare(torch.tensor([1, 2]), torch.tensor([1, 2]), torch.float32) is None


def test_the_other_rows_keep_their_per_entry_tolerance() -> None:
    expected = torch.tensor([100.0, 1e-3])
    assert comparison.compare(expected + torch.tensor([0.0, 0.5]), expected, tolerance="values") is not None


def test_values_under_vmap_alone_are_judged_per_entry() -> None:
    expected = torch.tensor([100.0, 1.0])
    mixed_up = torch.tensor([100.0, 0.95])  # the small entry is its neighbour sample's: 5% off
    assert case_stacks.tolerance_row("vmap") == "batched values"
    assert case_stacks.compare(mixed_up, expected, torch.float32, tolerance="batched values") is not None
    assert case_stacks.tolerance_row("vmap(grad)") == "derivatives"
