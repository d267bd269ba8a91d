"""Writes through a batched boolean mask inside use() (registry.core.mask_writes): each pattern, under each stack,
equals the per-sample loop outside any transform (values and gradients, float64); the fixed-shape writes never split
the batch, the per-element writes split it only where the samples' counts differ."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import func

import registry
from registry.core.batch_split import SPLITTER, BatchSplitWarning
from registry.core.control_flow import BooleanMaskError
from registry.core.mask_writes import where_form
from tests.per_sample import autograd_grad as _autograd_grad
from tests.per_sample import hessian as _hessian
from tests.per_sample import jacobian as _jacobian
from tests.per_sample import loop as _loop

TOL = {"rtol": 1e-12, "atol": 1e-12}
# Six samples of four features; their signs differ, so every mask below differs across the samples.
X = torch.tensor([[1.0, -2.0, 3.0, 0.5], [-1.0, 0.5, 0.0, -2.0], [2.0, 2.0, -0.5, 1.0],
                  [-3.0, 1.0, 1.0, 0.25], [1.0, 1.0, 2.0, -1.5], [0.5, -0.5, 4.0, 1.0]], dtype=torch.float64)
WEIGHTS = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
PYTORCH_SETITEM = torch.Tensor.__setitem__  # before any use() in this process installs the patch
ROW = torch.tensor([0.25, -1.5, 2.0], dtype=torch.float64)


@pytest.fixture(autouse=True)
def _split_warnings_apart() -> None:
    SPLITTER.forget_warnings()


def fill_a_number(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    out[x < 0] = 0.5
    return out * x.sin()


def fill_a_tensor_of_one(x: torch.Tensor) -> torch.Tensor:
    out = x * 2
    out[x > 0] = x.sum().reshape(1)  # one value, batched, for every selected element
    return out


def a_two_dimensional_mask(x: torch.Tensor) -> torch.Tensor:
    out = x.cos().reshape(2, 2)
    out[x.reshape(2, 2) > 0.5] = x[0] * 3
    return out.reshape(4)


def rows_of_a_matrix(x: torch.Tensor) -> torch.Tensor:
    table = x.reshape(4, 1) * ROW  # (4, 3): the mask selects rows, the row broadcasts over them
    table[x > 0] = ROW * x.sum()
    return table.sum(-1)


def a_column_slice_before_the_mask(x: torch.Tensor) -> torch.Tensor:
    table = x.reshape(1, 4).expand(2, 4).clone()
    table[:, x < 0] = -x.mean()
    return table.sum(0)


def a_fresh_buffer(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(4, dtype=x.dtype)  # not batched: the write makes it batched, use() functionalizes
    out[x > 0] = 1.0
    return out * x


FIXED = [fill_a_number, fill_a_tensor_of_one, a_two_dimensional_mask, rows_of_a_matrix, a_column_slice_before_the_mask,
         a_fresh_buffer]


def one_value_per_element(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    mask = x > 0
    out[mask] = x[mask] ** 2
    return out


def increment_through_the_mask(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    out[x > 0] += x[x > 0].exp()  # a read, then a write of one value per element
    return out


PER_ELEMENT = [one_value_per_element, increment_through_the_mask]


def _loss(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: (f(x) * WEIGHTS).sum()


# Each stack: (what runs inside use(), the reference outside any transform).
STACKS: dict[str, tuple[Callable, Callable]] = {
    "vmap": (lambda f: func.vmap(f)(X), lambda f: _loop(f, X)),
    "vmap(grad)": (lambda f: func.vmap(func.grad(_loss(f)))(X),
                   lambda f: torch.stack([_autograd_grad(_loss(f), x) for x in X])),
    "vmap(jacrev)": (lambda f: func.vmap(func.jacrev(f))(X), lambda f: torch.stack([_jacobian(f, x) for x in X])),
    "vmap(jacfwd)": (lambda f: func.vmap(func.jacfwd(f))(X), lambda f: torch.stack([_jacobian(f, x) for x in X])),
    "vmap(hessian)": (lambda f: func.vmap(func.hessian(_loss(f)))(X),
                      lambda f: torch.stack([_hessian(_loss(f), x) for x in X])),
    "grad(vmap)": (lambda f: func.grad(lambda b: (func.vmap(f)(b) * WEIGHTS).sum())(X),
                   lambda f: _autograd_grad(lambda b: (_loop(f, b) * WEIGHTS).sum(), X)),
    "vmap(vmap)": (lambda f: func.vmap(func.vmap(f))(torch.stack([X, X.flip(0) * -1])),
                   lambda f: torch.stack([_loop(f, b) for b in torch.stack([X, X.flip(0) * -1])])),
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("pattern", FIXED, ids=[p.__name__ for p in FIXED])
def test_a_fixed_shape_write_equals_the_loop_without_a_split(pattern: Callable, stack: str,
                                                             fallback_warnings: list) -> None:
    run, reference = STACKS[stack]
    expected = reference(pattern)
    with registry.use():
        got = run(pattern)
    torch.testing.assert_close(got, expected, **TOL)
    assert [w for w in fallback_warnings if issubclass(w.category, BatchSplitWarning)] == []
    assert [str(w.message) for w in fallback_warnings if "There is a performance drop" in str(w.message)] == []


@pytest.mark.parametrize("stack", ["vmap", "vmap(grad)", "vmap(jacrev)", "grad(vmap)"])
@pytest.mark.parametrize("pattern", PER_ELEMENT, ids=[p.__name__ for p in PER_ELEMENT])
def test_a_write_of_one_value_per_element_splits_and_equals_the_loop(pattern: Callable, stack: str) -> None:
    run, reference = STACKS[stack]
    expected = reference(pattern)
    with registry.use(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(pattern)
    torch.testing.assert_close(got, expected, **TOL)
    assert any(issubclass(w.category, BatchSplitWarning) for w in caught), "the counts differ: a split"


def test_a_write_of_one_value_per_element_with_agreeing_counts_runs_once() -> None:
    agreeing = (X.abs() + 0.1) * torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64)  # 3 positive entries each
    with registry.use(), warnings.catch_warnings():
        warnings.simplefilter("error", BatchSplitWarning)
        got = func.vmap(func.grad(_loss(one_value_per_element)))(agreeing)
    expected = torch.stack([_autograd_grad(_loss(one_value_per_element), x) for x in agreeing])
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("pattern", FIXED + PER_ELEMENT, ids=[p.__name__ for p in FIXED + PER_ELEMENT])
def test_the_patterns_fail_natively(pattern: Callable) -> None:
    """Outside use() each pattern fails under vmap (so the tests above test the kernels, not PyTorch)."""
    with pytest.raises(RuntimeError, match="boolean mask|index_put_"):
        func.vmap(pattern)(X)


def test_where_form_declines_what_it_cannot_write_as_where() -> None:
    x = torch.zeros(4, 3)
    mask = torch.tensor([True, False, True, False])
    assert where_form(x, [mask], torch.ones(2, 3), False) is None  # one row per selected row
    assert where_form(x, [mask, torch.tensor([0, 1])], torch.ones(()), False) is None  # two indices
    assert where_form(x, [mask], torch.ones((), dtype=torch.float64), False) is None  # index_put's dtype error
    torch.testing.assert_close(where_form(x, [mask], torch.tensor([1.0, 2.0, 3.0]), False),
                               torch.tensor([[1.0, 2.0, 3.0], [0, 0, 0], [1.0, 2.0, 3.0], [0, 0, 0]]))
    torch.testing.assert_close(where_form(x + 1, [mask], torch.full((1, 3), 2.0), True),
                               torch.tensor([[3.0, 3, 3], [1, 1, 1], [3, 3, 3], [1, 1, 1]]))


def test_an_explicit_index_put_with_a_batched_mask_names_the_line() -> None:
    """Only ``x[mask] = v`` is taken (registry.core.mask_writes.make_setitem says why): ``index_put_`` is refused."""
    def add_through_the_mask(x: torch.Tensor) -> torch.Tensor:
        return x.cos().index_put_((x > 0.5,), x[0] * 3, accumulate=True)

    with registry.use(), pytest.raises(BooleanMaskError, match="boolean-mask indexing at .*test_mask_writes.py"):
        func.vmap(add_through_the_mask)(X)


def test_uninstall_restores_setitem() -> None:
    with registry.use():
        func.vmap(fill_a_number)(X)  # the first refusal installs the patch
    assert torch.Tensor.__setitem__ is not PYTORCH_SETITEM
    registry.uninstall()
    try:
        assert torch.Tensor.__setitem__ is PYTORCH_SETITEM
    finally:
        registry.install()
    with registry.use():
        torch.testing.assert_close(func.vmap(fill_a_number)(X), _loop(fill_a_number, X), **TOL)
