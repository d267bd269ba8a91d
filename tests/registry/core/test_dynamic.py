"""Dynamic-shape ops under vmap inside use(): per sample where the shapes agree, else split, else the clear error."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import func

import registry
from registry.core import dynamic
from registry.core.batch_split import SPLITTER, BatchSplitWarning, SplitShapeError

pytestmark = pytest.mark.usefixtures("routing_backend")


@pytest.fixture(autouse=True)
def _split_warnings_apart() -> None:
    SPLITTER.forget_warnings()

X = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.5, 0.0]])
# Every op below gives these two samples outputs of different sizes (nonzero 3 and 2, unique 3 and 2, ...).
DIFFERING = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.0, -1.0]])


def _unique(t: torch.Tensor) -> torch.Tensor:
    return torch.unique(t)


CASES = [
    ("nonzero", torch.nonzero, "vmap: nonzero returns a shape that depends on the values of self, so it cannot be "
     "batched (each sample would need its own shape); use torch.nonzero_static(input, size=N, fill_value=-1), which "
     "pads every sample's indices to N rows"),
    ("argwhere", torch.argwhere, "vmap: argwhere returns a shape that depends on the values of self"),
    ("unique", _unique, "vmap: unique returns a shape that depends on the values of self, so it cannot be batched "
     "(each sample would need its own shape); sort the values"),
    ("masked_select", lambda t: t.masked_select(t > 0), "vmap: masked_select returns a shape that depends on the "
     "values of mask, so it cannot be batched (each sample would need its own shape); use torch.where(mask, self, "
     "fill)"),
]


@pytest.mark.parametrize(("name", "fn", "text"), CASES, ids=[c[0] for c in CASES])
def test_shapes_differing_at_the_levels_end_raise_with_the_alternative(name: str, fn, text: str) -> None:
    with registry.use(), pytest.warns(BatchSplitWarning), pytest.raises(SplitShapeError) as raised:
        func.vmap(fn)(DIFFERING)
    assert str(raised.value).startswith(text)
    assert "the groups' outputs still differ in shape at the end of the vmapped function" in str(raised.value)


AGREEING = [
    ("nonzero", torch.nonzero, torch.tensor([[1.0, 0.0, 3.0], [0.0, 2.0, 1.0]])),
    ("argwhere", torch.argwhere, torch.tensor([[1.0, 0.0, 3.0], [0.0, 2.0, 1.0]])),
    ("unique", lambda t: torch.unique(t, return_inverse=True, return_counts=True),
     torch.tensor([[1.0, 1.0, 3.0], [0.0, 2.0, 0.0]])),
    ("unique_consecutive", lambda t: torch.unique_consecutive(t, return_counts=True),
     torch.tensor([[1.0, 1.0, 3.0], [0.0, 0.0, 2.0]])),
    ("masked_select", lambda t: t.masked_select(t > 0), torch.tensor([[1.0, -2.0, 3.0], [4.0, 0.5, 0.0]])),
]


@pytest.mark.parametrize(("name", "fn", "batch"), AGREEING, ids=[c[0] for c in AGREEING])
def test_agreeing_shapes_run_per_sample_and_equal_the_loop(name: str, fn, batch: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchSplitWarning)  # nothing splits
        with registry.use():
            got = func.vmap(fn)(batch)
    expected = [fn(sample) for sample in batch]
    if isinstance(got, tuple):
        for column, part in enumerate(got):
            assert torch.equal(part, torch.stack([e[column] for e in expected]))
    else:
        assert torch.equal(got, torch.stack(expected))


def test_masked_select_keeps_its_gradient_per_sample() -> None:
    batch = torch.tensor([[1.0, -2.0, 3.0], [4.0, 0.5, -1.0]], dtype=torch.float64)

    def loss(t: torch.Tensor) -> torch.Tensor:
        return (t.masked_select(t > 0) ** 3).sum()

    with registry.use():
        got = func.vmap(func.grad(loss))(batch)
    assert torch.equal(got, torch.stack([func.grad(loss)(sample) for sample in batch]))


def _nonzero_of(t: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(t > 0)


def test_the_refusal_names_the_users_line() -> None:
    with registry.use(), pytest.warns(BatchSplitWarning), pytest.raises(SplitShapeError) as raised:
        func.vmap(_nonzero_of)(X)
    line = _nonzero_of.__code__.co_firstlineno + 1
    assert f" (called at {__file__}:{line} (`return torch.nonzero(t > 0)`)) (the batch was split" in str(raised.value)


def test_outside_use_pytorch_says_what_it_says() -> None:
    with pytest.raises(RuntimeError, match="We do not support batching operators that can output dynamic shape"):
        func.vmap(torch.nonzero)(X)


def test_policy_native_routes_nothing() -> None:
    with registry.use(policy="native"), pytest.raises(RuntimeError, match="We do not support batching operators"):
        func.vmap(torch.nonzero)(X)


def test_unbatched_mask_and_eager_calls_run_pytorch() -> None:
    mask = torch.tensor([True, False, True])
    with registry.use():
        assert torch.equal(func.vmap(lambda t: t.masked_select(mask))(X), X[:, [0, 2]])
        assert torch.equal(torch.nonzero(X > 0), torch.tensor([[0, 0], [0, 2], [1, 1]]))
        assert torch.equal(func.grad(lambda t: (t.masked_select(t > 0) ** 2).sum())(X),
                           torch.where(X > 0, 2 * X, torch.zeros_like(X)))


def test_every_declared_overload_names_an_alternative() -> None:
    for spec in dynamic.DYNAMIC_SHAPE.values():
        assert spec.alternative.startswith(("use ", "sort ")), spec
        assert "torch." in spec.alternative
