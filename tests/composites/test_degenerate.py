"""Inputs native PyTorch accepts at the edges of an op's shapes (empty tensors, a missing batch dimension, a target of
one element) work inside ``use()`` as they work natively, with the same values; each test compares with native
PyTorch outside ``use()`` and with a Python loop over the batch outside any transform."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F  # noqa: N812 -- PyTorch's own spelling
from torch import func
from torch.testing._internal.opinfo.core import SampleInput  # noqa: PLC2701 - the OpInfo database

import registry
from registry.harness import survey


def _loop(fn, *batched: torch.Tensor) -> torch.Tensor:
    return torch.stack([fn(*values) for values in zip(*batched, strict=True)])


def test_batch_norm_with_an_empty_input_of_one_dimension_runs_as_natively() -> None:
    def normalize(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, torch.zeros(0), torch.ones(0), training=False)

    inputs = torch.randn(3, 0)
    native = func.vmap(normalize)(inputs)
    with registry.use():
        used = func.vmap(normalize)(inputs)
    assert used.shape == native.shape == _loop(normalize, inputs).shape == (3, 0)


def test_batch_norm_without_a_channel_dimension_raises_natives_error_inside_use() -> None:
    def normalize(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, torch.zeros(3), torch.ones(3), training=False)

    with torch.no_grad():
        try:
            func.vmap(normalize)(torch.randn(2, 3))
        except RuntimeError as error:
            native = str(error)
        with registry.use():
            try:
                func.vmap(normalize)(torch.randn(2, 3))
            except RuntimeError as error:
                used = str(error)
    assert used == native


def test_take_with_an_empty_index_batched_on_its_last_dimension() -> None:
    source, index = torch.randn(2, 5), torch.zeros(0, 2, dtype=torch.int64)
    native = func.vmap(torch.take, in_dims=(0, 1))(source, index)
    with registry.use():
        used = func.vmap(torch.take, in_dims=(0, 1))(source, index)
    assert used.shape == native.shape == (2, 0)


def test_take_of_an_empty_input_under_jacfwd_fails_as_natively_and_vmap_returns_empty() -> None:
    source, index = torch.randn(3, 0), torch.zeros(3, 0, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # take's batching fallback warns natively
        native = func.vmap(torch.take)(source, index)
    with registry.use():
        used = func.vmap(torch.take)(source, index)
    assert used.shape == native.shape == (3, 0)


def test_multi_margin_loss_under_grad_accepts_a_target_of_one_element() -> None:
    scores, target = torch.randn(5, dtype=torch.float64), torch.tensor([2])
    for reduction in ("none", "mean", "sum"):
        def loss(x: torch.Tensor, reduction: str = reduction) -> torch.Tensor:
            return F.multi_margin_loss(x, target, reduction=reduction).sum()

        native = func.grad(loss)(scores)
        with registry.use():
            used = func.grad(loss)(scores)
        leaf = scores.clone().requires_grad_()
        (expected,) = torch.autograd.grad(loss(leaf), leaf)
        torch.testing.assert_close(used, expected)
        torch.testing.assert_close(native, expected)


def test_multi_margin_loss_keeps_natives_output_shape_for_a_target_of_one_element() -> None:
    def loss(x: torch.Tensor) -> torch.Tensor:
        return F.multi_margin_loss(x, torch.tensor([2]), reduction="none")

    scores = torch.randn(4, 5)
    with registry.use():
        used = func.vmap(loss)(scores)
    torch.testing.assert_close(used, _loop(loss, scores))
    assert used.shape == (4, 1)


def test_soft_margin_loss_under_jacfwd_over_the_target_is_zero_as_natively() -> None:
    scores = torch.randn(3, dtype=torch.float64)
    targets = torch.randn(4, 3, dtype=torch.float64).sign()

    def jacobian(target: torch.Tensor) -> torch.Tensor:
        return func.jacfwd(lambda t: F.soft_margin_loss(scores, t), argnums=0)(target)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the batching fallback warns natively
        native = func.vmap(jacobian)(targets)
    with registry.use():
        used = func.vmap(jacobian)(targets)
    torch.testing.assert_close(used, native)
    torch.testing.assert_close(used, torch.zeros(4, 3, dtype=torch.float64))


def test_soft_margin_loss_under_jacfwd_over_the_input_is_unchanged() -> None:
    scores = torch.randn(4, 3, dtype=torch.float64)
    target = torch.randn(3, dtype=torch.float64).sign()

    def jacobian(x: torch.Tensor) -> torch.Tensor:
        return func.jacfwd(lambda s: F.soft_margin_loss(s, target, reduction="none"))(x)

    with registry.use():
        used = func.vmap(jacobian)(scores)
    torch.testing.assert_close(used, _loop(lambda x: torch.autograd.functional.jacobian(
        lambda s: F.soft_margin_loss(s, target, reduction="none"), x), scores))


# --- max_unpool2d: duplicate indices ---------------------------------------------------------------------------------


def test_max_unpool2d_values_are_not_compared_where_indices_repeat() -> None:
    """PyTorch leaves the value at a repeated index unspecified: its channels_last kernel writes positions of one
    channel from several threads (on two threads, measured: a channels_last input gives another result than a
    contiguous one). The survey says so instead of reporting a mismatch, and still checks gradients (a gather)."""
    entry = next(e for e in survey.op_db() if survey.entry_id(e) == "nn.functional.max_unpool2d")
    values = torch.randn(1, 2, 2, 4, dtype=torch.float64)
    indices = torch.tensor([[11, 11, 5, 0, 7, 7, 9, 7], [5, 11, 9, 13, 11, 7, 11, 4]]).reshape(1, 2, 2, 4)
    sample = SampleInput(values, args=(indices,), kwargs={"kernel_size": 3, "stride": 2, "padding": 1,
                                                          "output_size": (3, 6)})
    case = survey.prepare_case(entry, sample, "input", 3, False)
    assert isinstance(case, survey.SurveyCase)
    reference = survey.Reference(case)
    outcomes = {stack: survey.check_case(stack, case, reference, torch.float64, inside_use=True, timeout_s=20)
                for stack in ("vmap", "vmap(jvp)", "vmap(grad)")}
    assert outcomes["vmap"].status == outcomes["vmap(jvp)"].status == "unsupported"
    assert "repeated indices" in outcomes["vmap"].detail
    assert outcomes["vmap(grad)"].status == "ok"
    assert survey.repeated_unpool_indices(indices, spatial=2)
    assert not survey.repeated_unpool_indices(torch.arange(8).reshape(1, 2, 2, 2), spatial=2)


def test_max_unpool2d_under_vmap_matches_the_loop_where_indices_do_not_repeat() -> None:
    values = torch.randn(3, 1, 2, 2, 2, dtype=torch.float64)
    indices = torch.stack([torch.randperm(12)[:8].reshape(1, 2, 2, 2) for _ in range(3)])

    def unpool(v: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return F.max_unpool2d(v, i, 2, output_size=(3, 4))

    assert not survey.repeated_unpool_indices(indices, spatial=2)
    with registry.use():
        used = func.vmap(unpool)(values, indices)
    torch.testing.assert_close(used, _loop(unpool, values, indices))
