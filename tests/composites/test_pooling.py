"""The pooling family (composites/pooling.py): max_unpool where indices repeat, which OpInfo's samples contain.

Where two positions of the input carry one index, PyTorch's forward AD scatters the tangents (one of them wins) while
its backward gathers (each gets the output's gradient), so natively jacfwd and jacrev disagree. The composite keeps
the value (the last write wins) and the backward, and makes the tangent the sum of the duplicates' tangents: the
Jacobian is the same in both modes.
"""

from __future__ import annotations

import torch
from torch.func import jacfwd, jacrev, jvp, vmap

import registry
from tests.composites.test_reduce import no_vmap_fallback

VALUES = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.float64).unsqueeze(-1)  # (1, 1, 3, 1)
INDICES = torch.tensor([[[1, 1, 2]]]).unsqueeze(-1)  # positions 0 and 1 both write output position 1


def _unpool(values: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.max_unpool2d(values, INDICES, [3, 1])


def test_native_jacobians_disagree_where_indices_repeat() -> None:
    assert not torch.equal(jacfwd(_unpool)(VALUES), jacrev(_unpool)(VALUES))


def test_composite_tangent_sums_the_duplicates_and_jacobians_agree() -> None:
    tangents = torch.tensor([[[[10.0], [20.0], [30.0]]]], dtype=torch.float64)
    with no_vmap_fallback():
        value, tangent = vmap(lambda v, t: jvp(_unpool, (v,), (t,)))(VALUES.unsqueeze(0), tangents.unsqueeze(0))
        forward = jacfwd(_unpool)(VALUES)
    assert value.flatten().tolist() == [0.0, 2.0, 3.0]  # one thread's order: the last write wins
    assert tangent.flatten().tolist() == [0.0, 30.0, 30.0]
    assert torch.equal(forward, jacrev(_unpool)(VALUES))  # native backward: every duplicate gets the gradient


def test_composite_equals_native_without_duplicates() -> None:
    indices = torch.tensor([[[0, 1, 2]]]).unsqueeze(-1)
    values = torch.randn(4, 1, 1, 3, 1, dtype=torch.float64)
    expected = torch.stack([torch.ops.aten.max_unpool2d(v, indices, [3, 1]) for v in values])
    with registry.use(pins={"max_unpool2d": "functional"}):
        actual = vmap(lambda v: torch.ops.aten.max_unpool2d(v, indices, [3, 1]))(values)
    assert torch.equal(actual, expected)
