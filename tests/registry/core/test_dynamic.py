"""Dynamic-shape ops under vmap inside use(): an error that says why and names the fixed-shape alternative."""

from __future__ import annotations

import pytest
import torch
from torch import func

import registry
from registry.core import dynamic

pytestmark = pytest.mark.usefixtures("routing_backend")

X = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.5, 0.0]])


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
def test_refused_under_vmap_inside_use_with_the_alternative(name: str, fn, text: str) -> None:
    with registry.use(), pytest.raises(RuntimeError) as raised:
        func.vmap(fn)(X)
    assert str(raised.value).startswith(text)


def _nonzero_of(t: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(t > 0)


def test_the_refusal_names_the_users_line() -> None:
    with registry.use(), pytest.raises(RuntimeError) as raised:
        func.vmap(_nonzero_of)(X)
    line = _nonzero_of.__code__.co_firstlineno + 1
    assert str(raised.value).endswith(f" (called at {__file__}:{line} (`return torch.nonzero(t > 0)`))")


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
