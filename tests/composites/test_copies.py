"""What the generic OpInfo test cannot see for the copies and linear-algebra families: the derivative kernels behind
a native pin, the dynamic-shape error of tensor_split, the rule family that keeps native under jacfwd, and the
harness looking past samples that never call a routed overload."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import grad, jacrev, vmap

import registry
from registry.core import rules
from registry.core.context import Context
from registry.harness import opinfo

FALLBACK = "There is a performance drop"


def _fallback_warnings(fn, *args) -> tuple[object, list[str]]:
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught if FALLBACK in str(w.message)]


def test_unfold_backward_is_batched_inside_use_with_native_unfold() -> None:
    """unfold stays PyTorch's own view inside use(); its backward, unfold_backward, has no batching rule in PyTorch
    (vmap(grad) loops), and the derivative kernel batches it."""
    x = torch.randn(3, 7)

    def loss(row: torch.Tensor) -> torch.Tensor:
        return row.unfold(0, 3, 2).pow(2).sum()

    expected = torch.stack([grad(loss)(row) for row in x])
    _, outside = _fallback_warnings(vmap(grad(loss)), x)
    assert any("aten::unfold_backward" in message for message in outside)
    with registry.use(pins={"unfold": "native"}):
        actual, inside = _fallback_warnings(vmap(grad(loss)), x)
    assert inside == []
    torch.testing.assert_close(actual, expected)


def test_cummaxmin_backward_is_batched_inside_use_with_native_cummax() -> None:
    x = torch.randn(6)

    def running_max(v: torch.Tensor) -> torch.Tensor:
        return torch.cummax(v, 0).values

    expected = torch.autograd.functional.jacobian(running_max, x)
    _, outside = _fallback_warnings(jacrev(running_max), x)
    assert any("aten::cummaxmin_backward" in message for message in outside)
    with registry.use(pins={"cummax": "native"}):
        actual, inside = _fallback_warnings(jacrev(running_max), x)
    assert inside == []
    torch.testing.assert_close(actual, expected)


def test_tensor_split_with_indices_that_differ_per_sample_says_why_it_cannot_batch() -> None:
    x = torch.randn(3, 6)
    indices = torch.tensor([[1, 4], [2, 3], [1, 4]])
    with registry.use(), pytest.raises(RuntimeError) as raised:
        vmap(lambda row, at: torch.tensor_split(row, at))(x, indices)
    assert str(raised.value) == (
        "tensor_split: tensor_indices_or_sections differs across the vmapped batch, so each sample's outputs would "
        "have other shapes: vmap does not support batching operators that can output dynamic shape. Pass the same "
        "tensor_indices_or_sections to every sample (unbatched), or pad the outputs to one shape yourself.")


def test_tensor_split_with_the_same_indices_in_every_sample_batches() -> None:
    x = torch.randn(3, 6)
    indices = torch.tensor([1, 4]).expand(3, 2)
    with registry.use():
        pieces = vmap(lambda row, at: torch.tensor_split(row, at))(x, indices)
    assert [tuple(p.shape) for p in pieces] == [(3, 1), (3, 3), (3, 2)]
    for piece, expected in zip(pieces, torch.tensor_split(x, [1, 4], dim=1), strict=True):
        torch.testing.assert_close(piece, expected)


def test_fill_with_a_value_of_one_dimension_raises_natives_error() -> None:
    with pytest.raises(RuntimeError) as native:
        torch.fill(torch.zeros(3), torch.ones(2))
    with registry.use(pins={"fill": "functional"}), pytest.raises(RuntimeError) as composite:
        vmap(lambda v: torch.fill(v, torch.ones(2)))(torch.zeros(2, 3))
    assert str(composite.value) == str(native.value)


@pytest.mark.parametrize(("stack", "batched", "expected"), [
    (("vmap",), ("self",), "slow"),
    (("vmap", "grad"), ("self",), "slow"),
    (("vmap", "jvp"), (), None),  # jacfwd: the primal is unbatched, only the tangent is
    (("vmap", "vmap"), (), "slow"),  # batched at an outer level: the context names only the innermost
    (("grad",), (), None),
])
def test_batched_without_batching_rule_fires_only_where_an_argument_is_batched(
        stack: tuple[str, ...], batched: tuple[str, ...], expected: str | None) -> None:
    rule = rules.batched_without_batching_rule("aten::permute_copy", "self")
    found = rule(Context(stack=stack, batched=batched))
    assert (found.status if found is not None else None) == expected
    if found is not None:
        assert found.evidence == ("aten::permute_copy has no batching rule, so vmap runs a per-sample loop where "
                                  "self is batched")


def test_opinfo_check_looks_past_samples_that_never_call_the_routed_overload() -> None:
    """narrow's first OpInfo sample has an int start (narrow.default, not routed): with one sample allowed, the check
    used to report it as never reaching aten::narrow; the next sample, with a tensor start, is the one checked."""
    outcome = opinfo.check("narrow", "functional", torch.float32, ("vmap",), "self", limit_samples=1)
    assert (outcome.status, outcome.detail) == ("ok", "")


@pytest.mark.parametrize(("stack", "expected"), [
    (("vmap",), True), (("grad", "vmap"), True), (("vmap", "grad"), False), (("vmap", "jvp"), False), ((), False),
])
def test_innermost_vmap_is_where_an_op_that_decomposes_under_autograd_reaches_the_batched_key(
        stack: tuple[str, ...], expected: bool) -> None:
    assert rules.innermost_vmap(Context(stack=stack)) is expected
