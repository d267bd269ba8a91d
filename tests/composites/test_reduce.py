"""The scatter-reduction family (composites/reduce.py): what the generic OpInfo test cannot see.

OpInfo's samples of scatter_reduce and index_reduce hardly ever put a zero in a slot, and segment_reduce's never
leave a segment empty; these pin the values and gradients there, under the transforms where PyTorch's own kernels
raise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.func import grad, jacfwd, jacrev, vmap

import registry

FALLBACK = "There is a performance drop"


@contextmanager
def no_vmap_fallback(pins: dict[str, str] | None = None) -> Iterator[None]:
    """Inside use() (with ``pins``), without vmap's per-sample loop (PyTorch warns when it falls back to it)."""
    with warnings.catch_warnings(record=True) as caught, registry.use(pins=pins):
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == []


ITEM_ERROR = "vmap: It looks like you're either (1) calling .item() on a Tensor"

SELF = torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.float64)
INDEX = torch.tensor([0, 1, 1, 2, 2])
# Row 0: slot 1 holds one zero (its gradient is the product of the others), slot 2 two (self's and src's: 0).
SRC = torch.tensor([[3.0, 0.0, 5.0, 0.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
EXPECTED_GRAD = torch.tensor([[1.0, 10.0, 0.0, 0.0, 0.0], [1.0, 6.0, 4.0, 0.0, 0.0]], dtype=torch.float64)


def _scatter_prod_sum(src: torch.Tensor) -> torch.Tensor:
    return torch.scatter_reduce(SELF, 0, INDEX, src, "prod", include_self=True).sum()


def _index_prod_sum(src: torch.Tensor) -> torch.Tensor:
    return torch.index_reduce(SELF, 0, INDEX, src, "prod").sum()


@pytest.mark.parametrize("fn", [_scatter_prod_sum, _index_prod_sum], ids=["scatter_reduce", "index_reduce"])
def test_prod_under_vmap_of_grad_raises_natively_and_is_exact_inside_use(
        fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    with pytest.raises(RuntimeError) as raised:
        vmap(grad(fn))(SRC)
    assert str(raised.value).startswith(ITEM_ERROR)
    loop = torch.stack([grad(fn)(row) for row in SRC])
    assert torch.equal(loop, EXPECTED_GRAD)
    with no_vmap_fallback():
        assert torch.equal(vmap(grad(fn))(SRC), EXPECTED_GRAD)


def test_prod_second_derivatives_equal_native_where_no_two_zeros_meet() -> None:
    src = SRC[1]
    expected = torch.autograd.functional.hessian(_scatter_prod_sum, src)
    with registry.use(pins={"scatter_reduce": "functional"}):
        actual = jacfwd(jacrev(_scatter_prod_sum))(src)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


def _segment(data: torch.Tensor, reduce: str, initial: float | None) -> torch.Tensor:
    return torch.segment_reduce(data, reduce, lengths=torch.tensor([2, 0, 3]), initial=initial)


@pytest.mark.parametrize(("reduce", "initial", "expected"), [
    ("mean", None, [3.0, math.nan, 4.0]),
    ("mean", 2.0, [4.0, 2.0, 14.0 / 3.0]),
    ("max", None, [5.0, -math.inf, 7.0]),
    ("max", 6.0, [6.0, 6.0, 7.0]),
    ("min", None, [1.0, math.inf, 2.0]),
    ("prod", 2.0, [10.0, 2.0, 84.0]),
    ("sum", None, [6.0, 0.0, 12.0]),
])
def test_segment_reduce_empty_segments_under_vmap(reduce: str, initial: float | None, expected: list[float]) -> None:
    data = torch.tensor([[1.0, 5.0, 3.0, 2.0, 7.0]] * 2, dtype=torch.float64)
    # The composite pinned: at two samples of five elements auto may pick vmap's loop over PyTorch's op by cost.
    with no_vmap_fallback(pins={"segment_reduce": "functional"}):
        out = vmap(lambda row: _segment(row, reduce, initial))(data)
    want = torch.tensor([expected] * 2, dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12, equal_nan=True)


def test_segment_reduce_max_gradient_skips_initial_and_splits_ties() -> None:
    # initial 6 is beyond segment 0's data: no gradient there; segment 2's data tie at 7: half each.
    data = torch.tensor([1.0, 5.0, 7.0, 2.0, 7.0], dtype=torch.float64)
    native = torch.func.grad(lambda d: _segment(d, "max", 6.0).sum())(data)
    assert native.tolist() == [0.0, 0.0, 0.5, 0.0, 0.5]
    with no_vmap_fallback(pins={"segment_reduce": "functional"}):
        assert torch.equal(vmap(grad(lambda d: _segment(d, "max", 6.0).sum()))(data.unsqueeze(0))[0], native)


# --- scatter_add with a row index as multicomposite::add_rows (registry/core/kernels/rows.cpp) ---------------------

NODES, EDGES, FEATURES, BATCH = 5, 8, 3, 4


def _scatter_sum(src: torch.Tensor, target: torch.Tensor, inplace: bool = True) -> torch.Tensor:
    """A graph library's ``scatter(src, target, dim=0, reduce="sum")``: the row index expanded over the features."""
    index = target.view(-1, 1).expand_as(src)
    buffer = src.new_zeros(NODES, src.shape[1])
    return buffer.scatter_add_(0, index, src) if inplace else buffer.scatter_add(0, index, src)


def _messages(src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (_scatter_sum(src, target) * torch.linspace(0.5, 2.0, FEATURES, dtype=src.dtype)).square().sum()


def _graph_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return (torch.randn(BATCH, EDGES, FEATURES, generator=generator, dtype=torch.float64),
            torch.randint(0, NODES, (BATCH, EDGES), generator=generator))


def test_per_sample_gradients_of_a_scatter_sum_run_the_rows_ops_and_equal_the_loop() -> None:
    src, target = _graph_data()
    with registry.use(record=True) as run:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            got = vmap(grad(_messages))(src, target)
    assert {(d.op, d.kind) for d in run.decisions if d.op == "scatter_add"} == {("scatter_add", "cpp_op")}
    ran = {event.key for event in profile.key_averages()}
    assert {"multicomposite::add_rows", "multicomposite::gather_rows"} <= ran
    assert "aten::gather" not in ran
    for b in range(BATCH):
        sample = src[b].clone().requires_grad_()
        torch.testing.assert_close(got[b], torch.autograd.grad(_messages(sample, target[b]), sample)[0])


_SCATTER_STACKS: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "vmap(grad) out of place": lambda s, t: vmap(grad(lambda x, j: _scatter_sum(x, j, False).sin().sum()))(s, t),
    "vmap(grad) shared index": lambda s, t: vmap(grad(lambda x: _scatter_sum(x, t[0], False).sin().sum()))(s),
    "vmap(jacrev)": lambda s, t: vmap(jacrev(lambda x, j: _scatter_sum(x, j, False).sin()))(s, t),
    "vmap(jacfwd)": lambda s, t: vmap(jacfwd(lambda x, j: _scatter_sum(x, j, False).sin().sum()))(s, t),
    "grad(grad)": lambda s, t: grad(lambda x: grad(lambda y: _scatter_sum(y, t[0], False).sin().sum())(x)
                                    .square().sum())(s[0]),
}


@pytest.mark.parametrize("stack", list(_SCATTER_STACKS))
def test_pinned_rows_op_equals_pytorchs_scatter_add(stack: str) -> None:
    src, target = _graph_data()
    native = _SCATTER_STACKS[stack](src, target)
    with registry.use(pins={"scatter_add": "cpp_op"}, record=True) as run:
        got = _SCATTER_STACKS[stack](src, target)
    assert {d.kind for d in run.decisions if d.op == "scatter_add"} == {"cpp_op"}
    torch.testing.assert_close(got, native)


def test_scatter_add_without_a_row_index_is_pytorchs() -> None:
    """An index that differs along the features, another dimension: aten::scatter_add, its values and gradients,
    under vmap(grad) too."""
    src, target = _graph_data()

    def others(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        full = (j.view(-1, 1) + torch.arange(FEATURES)) % NODES
        return (x.new_zeros(NODES, FEATURES).scatter_add(0, full, x).square().sum()
                + x.new_zeros(FEATURES, NODES).scatter_add(1, full.t(), x.t()).sin().sum())

    native = vmap(grad(others))(src, target)
    with registry.use(pins={"scatter_add": "cpp_op"}):
        torch.testing.assert_close(vmap(grad(others))(src, target), native)
