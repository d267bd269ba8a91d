"""Batch splitting at a vmap level inside use(): each pattern where samples disagree, under each named stack, equals
the per-sample loop outside any transform (values and gradients, float64)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import func

import registry
from registry.core.batch_split import SPLITTER, BatchSplitWarning, SplitShapeError
from tests.per_sample import autograd_grad as _autograd_grad
from tests.per_sample import jacobian as _jacobian
from tests.per_sample import loop as _loop

pytestmark = pytest.mark.usefixtures("routing_backend")

TOL = {"rtol": 1e-12, "atol": 1e-12}
# Six samples of four features: the patterns below disagree across them.
X = torch.tensor([[1.0, -2.0, 3.0, 0.5], [-1.0, 0.5, 0.0, -2.0], [2.0, 2.0, -0.5, 1.0],
                  [-3.0, 1.0, 1.0, 0.25], [1.0, 1.0, 2.0, -1.5], [0.5, -0.5, 4.0, 1.0]], dtype=torch.float64)
WEIGHTS = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)


@pytest.fixture(autouse=True)
def _split_warnings_apart() -> None:
    SPLITTER.forget_warnings()


def branch_bool(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x.sin() * 2
    return x ** 3


def branch_item(x: torch.Tensor) -> torch.Tensor:
    count = int((x > 0).sum().item())  # 3, 2, 3, 3, 3, 3 ... per sample
    return x * count + x ** 2


def branch_equal(x: torch.Tensor) -> torch.Tensor:
    if torch.equal(x.clamp(min=-1), x):
        return x * 2
    return x.cos()


def branch_mask_all(x: torch.Tensor) -> torch.Tensor:
    mask = x > -1
    if mask.all():
        return x.exp()
    return x.masked_fill(~mask, 0.0).exp()


def mask_indexed_then_fixed(x: torch.Tensor) -> torch.Tensor:
    """Per-sample shapes differ in the middle (boolean-mask indexing, nonzero) and agree again by the end."""
    mask = x > 0
    kept = x[mask]
    positions = torch.nonzero(mask).squeeze(-1)
    return torch.zeros_like(x).index_add(0, positions, kept.sin() * kept)


PATTERNS = [branch_bool, branch_item, branch_equal, branch_mask_all, mask_indexed_then_fixed]


def _loss(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: (f(x) * WEIGHTS).sum()


# Each stack: (what runs inside use(), the reference outside any transform).
STACKS: dict[str, tuple[Callable, Callable]] = {
    "vmap": (lambda f: func.vmap(f)(X), lambda f: _loop(f, X)),
    "vmap(grad)": (lambda f: func.vmap(func.grad(_loss(f)))(X),
                   lambda f: torch.stack([_autograd_grad(_loss(f), x) for x in X])),
    "vmap(jacrev)": (lambda f: func.vmap(func.jacrev(f))(X), lambda f: torch.stack([_jacobian(f, x) for x in X])),
    "jacrev(vmap)": (lambda f: func.jacrev(func.vmap(f))(X), lambda f: _jacobian(lambda b: _loop(f, b), X)),
    "grad(vmap)": (lambda f: func.grad(lambda b: (func.vmap(f)(b) * WEIGHTS).sum())(X),
                   lambda f: _autograd_grad(lambda b: (_loop(f, b) * WEIGHTS).sum(), X)),
    "vmap(vmap)": (lambda f: func.vmap(func.vmap(f))(torch.stack([X, X.flip(0) * -1])),
                   lambda f: torch.stack([_loop(f, b) for b in torch.stack([X, X.flip(0) * -1])])),
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.__name__ for p in PATTERNS])
def test_pattern_equals_the_loop(pattern: Callable, stack: str, fallback_warnings: list) -> None:
    run, reference = STACKS[stack]
    expected = reference(pattern)
    with registry.use():
        got = run(pattern)
    torch.testing.assert_close(got, expected, **TOL)
    splits = [w for w in fallback_warnings if issubclass(w.category, BatchSplitWarning)]
    assert len(splits) >= 1, "the samples disagree: the batch must have been split"
    assert [str(w.message) for w in fallback_warnings if "There is a performance drop" in str(w.message)] == []


def test_the_patterns_disagree_natively() -> None:
    """Outside use() each pattern fails under vmap (so the tests above test the split, not PyTorch)."""
    for pattern in PATTERNS:
        with pytest.raises(RuntimeError):
            func.vmap(pattern)(X)


def test_in_dims_out_dims_none_and_pytrees() -> None:
    def f(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, scale = inputs["a"], inputs["scale"]
        return branch_bool(a) * scale, scale * 2

    batched = {"a": X.T, "scale": WEIGHTS}
    with registry.use(), pytest.warns(BatchSplitWarning):
        values, shared = func.vmap(f, in_dims=({"a": 1, "scale": None},), out_dims=(1, None))(batched)
    torch.testing.assert_close(values, _loop(lambda a: branch_bool(a) * WEIGHTS, X).T, **TOL)
    assert torch.equal(shared, WEIGHTS * 2)


def two_branches(x: torch.Tensor) -> torch.Tensor:
    y = x * 2 if x[0] > 0 else x - 1  # first split: by the sign of x[0]
    if y.sum() > 6:  # a second split inside a group
        return y.tanh()
    return y ** 2


def test_a_second_branch_splits_a_group_again() -> None:
    with registry.use(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = func.vmap(func.grad(_loss(two_branches)))(X)
    expected = torch.stack([_autograd_grad(_loss(two_branches), x) for x in X])
    torch.testing.assert_close(got, expected, **TOL)
    sites = sorted(str(w.message).split(" disagree at ")[1].split(" (`")[0].rsplit(":", 1)[1]
                   for w in caught if issubclass(w.category, BatchSplitWarning))
    first = two_branches.__code__.co_firstlineno
    assert sites == sorted([str(first + 1), str(first + 2)])


def test_the_warning_once_per_call_site_with_where_and_how_many() -> None:
    with registry.use(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        func.vmap(branch_bool)(X)
        func.vmap(branch_bool)(X * 2)
    splits = [w for w in caught if issubclass(w.category, BatchSplitWarning)]
    assert len(splits) == 1
    text = str(splits[0].message)
    line = branch_bool.__code__.co_firstlineno + 1
    assert text.startswith(f"vmap: the samples of a batch of 6 disagree at {__file__}:{line} (`if x.sum() > 0:`), "
                           "so the batch was split into 2 groups of agreeing samples (sizes 4, 2)")
    assert "torch.where(cond, if_true, if_false)" in text
    assert splits[0].filename == __file__  # where the user called vmap


def test_the_agreeing_path_runs_the_function_once_and_a_split_once_per_group() -> None:
    """Python side effects before the branch run again per group (documented); agreeing samples re-run nothing."""
    calls: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return branch_bool(x)

    with registry.use(), warnings.catch_warnings():
        warnings.simplefilter("error", BatchSplitWarning)
        func.vmap(counted)(X.abs())  # every sample has a positive sum
    assert len(calls) == 1
    calls.clear()
    with registry.use(), pytest.warns(BatchSplitWarning):
        func.vmap(counted)(X)
    assert len(calls) == 1 + 2  # the first run up to the branch, then one run per group


def random_branch(x: torch.Tensor) -> torch.Tensor:
    noise = torch.rand(4, dtype=torch.float64)
    if x.sum() > 0:
        return x + noise
    return x - noise


def test_randomness_same_draws_one_value_for_every_group() -> None:
    torch.manual_seed(0)
    with registry.use(), pytest.warns(BatchSplitWarning):
        got = func.vmap(random_branch, randomness="same")(X)
    noise = (got - X).abs()
    assert torch.allclose(noise, noise[:1].expand_as(noise), rtol=0, atol=1e-15)
    torch.manual_seed(0)
    assert torch.allclose(noise[0], torch.rand(4, dtype=torch.float64), rtol=0, atol=1e-15)


def test_randomness_different_draws_per_sample_and_error_refuses() -> None:
    with registry.use(), pytest.warns(BatchSplitWarning):
        got = func.vmap(random_branch, randomness="different")(X)
    noise = (got - X).abs()
    assert len({tuple(row.tolist()) for row in noise}) == len(X)
    assert bool(((noise >= 0) & (noise < 1)).all())
    with registry.use(), pytest.raises(RuntimeError, match="randomness"):
        func.vmap(random_branch, randomness="error")(X)


def test_shapes_that_never_agree_again_raise_the_clear_error() -> None:
    with registry.use(), pytest.raises(SplitShapeError, match="boolean-mask indexing at .* returns a shape"):
        func.vmap(lambda x: x[x > 0])(X)


def test_outside_use_nothing_changes() -> None:
    with pytest.raises(RuntimeError, match="data-dependent control flow"):
        func.vmap(branch_bool)(X)
    with pytest.raises(RuntimeError, match="Batching rule not implemented for aten::equal"):
        func.vmap(branch_equal)(X)
