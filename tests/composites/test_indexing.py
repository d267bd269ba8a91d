"""The flat-index family (composites/indexing.py): what the generic OpInfo test cannot see."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling
from torch.func import grad, hessian, jacfwd, jacrev, vmap
from torch.utils._pytree import tree_leaves  # noqa: PLC2701 - PyTorch's pytree

import registry
from composites.our_ops import OPS as CPP_OPS
from tests.composites.test_reduce import FALLBACK, no_vmap_fallback

INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 2])
OFFSETS = torch.tensor([0, 4, 4, 8])  # bag 1 is empty


def _bag_sum(weight: torch.Tensor, mode: str) -> torch.Tensor:
    return F.embedding_bag(INDICES, weight, OFFSETS, mode=mode, scale_grad_by_freq=True).sum()


def test_embedding_bag_scale_grad_by_freq_is_pytorchs_cpu_gradient() -> None:
    # PyTorch's CPU backward divides the i-th distinct index (sorted) by the count of the i-th sorted index: index 3
    # occurs once yet gets 1/3, index 9 gets 1/2 (F.embedding would give every used row 1).
    weight = torch.randn(10, 3, dtype=torch.float64)
    native = grad(_bag_sum)(weight, "sum")[:, 0]
    assert native.tolist() == [0.0, 1.0, 1.0, 1 / 3, 2 / 3, 1.0, 0.0, 0.0, 0.0, 0.5]
    weights = torch.stack([weight, 2 * weight])
    for mode in ("sum", "mean"):
        loop = torch.stack([grad(_bag_sum)(w, mode) for w in weights])
        with no_vmap_fallback():
            batched = vmap(grad(_bag_sum), in_dims=(0, None))(weights, mode)
        torch.testing.assert_close(batched, loop, rtol=0, atol=1e-15)


def test_embedding_bag_auxiliary_outputs_equal_native() -> None:
    weight = torch.randn(10, 3)
    for mode in (0, 1, 2):
        for padding_idx in (None, 2):
            args = (weight, INDICES, OFFSETS, False, mode, False, None, False, padding_idx)
            expected = torch.ops.aten.embedding_bag.padding_idx(*args)
            actual = registry.composites("embedding_bag")["functional"].fn(*args)
            for got, want in zip(actual, expected, strict=True):
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got, want)


def test_nonzero_static_under_vmap() -> None:
    """The functional composite batches (pinned: at three samples of four elements ``auto`` picks vmap's loop over
    PyTorch's op by the reference costs, composites/indexing.py's ``sizes``)."""
    rows = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    with warnings.catch_warnings(record=True) as caught, registry.use(pins={"nonzero_static": "functional"}):
        warnings.simplefilter("always")
        found = vmap(lambda row: torch.nonzero_static(row, size=3, fill_value=-5))(rows)
    assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == []
    assert found.tolist() == [[[1], [2], [-5]], [[0], [-5], [-5]], [[-5], [-5], [-5]]]
    assert torch.equal(found, torch.stack([torch.nonzero_static(r, size=3, fill_value=-5) for r in rows]))


# --- one_hot: per-sample gradients of a loss with one-hot targets ----------------------------------------------------


def _one_hot_loss(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return -(F.one_hot(label, 5).to(logits.dtype) * logits.log_softmax(-1)).sum()


def test_one_hot_targets_under_vmap_grad_equal_the_loop() -> None:
    """PyTorch's one_hot checks the labels' bounds with .item() at the grad level, which vmap refuses; inside use()
    the functional composite (functorch's own decomposition) runs there, and the gradients are the loop's."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 5, dtype=torch.float64, generator=g), torch.randint(0, 5, (6,), generator=g)
    try:
        vmap(grad(_one_hot_loss))(logits, labels)
    except RuntimeError as error:
        assert "calling .item() on a Tensor" in str(error)
    else:
        raise AssertionError("PyTorch's one_hot now works under vmap(grad): its native rule can go")
    with registry.use(record=True) as run:
        got = vmap(grad(_one_hot_loss))(logits, labels)
    assert [(d.op, d.composite) for d in run.decisions if d.op == "one_hot"] == [("one_hot", "functional")]
    # The loop: one torch.autograd.grad per sample, outside any transform.
    expected = torch.stack([torch.autograd.grad(_one_hot_loss(leaf, y), leaf)[0]
                            for leaf, y in ((z.clone().requires_grad_(), y) for z, y in zip(logits, labels,
                                                                                               strict=True))])
    torch.testing.assert_close(got, expected)


def test_one_hot_under_plain_vmap_stays_pytorchs() -> None:
    """Under vmap alone functorch's own decomposition already batches one_hot: nothing is routed."""
    labels = torch.randint(0, 5, (4, 3))
    with registry.use(record=True) as run:
        got = vmap(lambda y: F.one_hot(y, 5))(labels)
    assert [d.composite for d in run.decisions if d.op == "one_hot"] in ([], ["native"])
    torch.testing.assert_close(got, F.one_hot(labels, 5))


# --- x[index] through the rows ops' batching rules (registry/core/kernels/batch_rules.cpp, rows.cpp) -------------

ROWS, WIDTH, BATCH = 6, 3, 4


def _gathered(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A graph layer's reads: rows at an index (twice, negative indices too), weighted and squared."""
    return ((h[index] * torch.linspace(0.5, 1.5, WIDTH, dtype=h.dtype)).square().sum()
            + h[index.flip(0) - ROWS].sin().sum())


def _rows_data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    h = torch.randn(BATCH, ROWS, WIDTH, generator=generator, dtype=dtype)
    return h, torch.randint(0, ROWS, (BATCH, 7), generator=generator)


def _loop_row_gradients(f: Any, h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    rows = []
    for b in range(h.shape[0]):
        sample = h[b].clone().requires_grad_()
        rows.append(torch.autograd.grad(f(sample, index[b]), sample)[0])
    return torch.stack(rows)


def _ops_run(f: Callable[[], Any]) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        f()
    return {event.key: event.count for event in profile.key_averages()}


@pytest.mark.usefixtures("cpp_routing")  # the batching rules are the C++ backend's
def test_per_sample_gradients_of_row_reads_run_the_rows_ops_and_equal_the_loop() -> None:
    """vmap(grad) with each sample's own index: inside use() gather_rows forward and add_rows backward, folded,
    where functorch indexes with an arange over the batch and backs it with index_put's accumulating kernel; outside
    use() PyTorch's rules as before. The gradients equal autograd's one sample at a time."""
    h, index = _rows_data()
    with no_vmap_fallback():
        ran = _ops_run(lambda: vmap(grad(_gathered))(h, index))
        got = vmap(grad(_gathered))(h, index)
    assert ran["multicomposite::gather_rows"] == 2 and ran["multicomposite::add_rows"] == 2
    assert "aten::_index_put_impl_" not in ran
    assert ran["aten::index"] == 2  # the function's own two calls, each one rule
    torch.testing.assert_close(got, _loop_row_gradients(_gathered, h, index))
    outside = _ops_run(lambda: vmap(grad(_gathered))(h, index))
    assert "multicomposite::gather_rows" not in outside and "aten::_index_put_impl_" in outside


_ROW_STACKS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "vmap": lambda h, i: vmap(_gathered)(h, i),
    "vmap(grad)": lambda h, i: vmap(grad(_gathered))(h, i),
    "vmap(grad) shared index": lambda h, i: vmap(grad(_gathered), in_dims=(0, None))(h, i[0]),
    "vmap(grad) shared rows": lambda h, i: vmap(grad(_gathered), in_dims=(None, 0))(h[0], i),
    "vmap(grad) batch last": lambda h, i: vmap(grad(_gathered), in_dims=(2, 1))(h.permute(1, 2, 0), i.t()),
    "vmap(grad) int32 index": lambda h, i: vmap(grad(_gathered))(h, i.int()),
    "vmap(vmap(grad))": lambda h, i: vmap(vmap(grad(_gathered)))(h.view(2, 2, ROWS, WIDTH), i.view(2, 2, -1)),
    "vmap(jacrev)": lambda h, i: vmap(jacrev(lambda x, j: x[j].cos()))(h, i),
    "vmap(jacfwd)": lambda h, i: vmap(jacfwd(_gathered))(h, i),
    "vmap(hessian)": lambda h, i: vmap(hessian(lambda x, j: x[j].sin().sum() + x[j - 3].square().sum()))(
        h[:, :3], i.clamp(max=2)),
    "grad(vmap)": lambda h, i: grad(lambda x: vmap(_gathered)(x, i).sum())(h),
}


@pytest.mark.usefixtures("cpp_routing")  # the batching rules are the C++ backend's
@pytest.mark.parametrize("stack", list(_ROW_STACKS))
def test_row_reads_inside_use_equal_pytorchs(stack: str) -> None:
    """Under every stack inside use() (the rules fold where both are batched; each backward is the other rows op,
    differentiable again, with tangents) the values are PyTorch's outside use()."""
    h, index = _rows_data()
    native = _ROW_STACKS[stack](h, index)
    with registry.use():
        got = _ROW_STACKS[stack](h, index)
    for mine, theirs in zip(tree_leaves(got), tree_leaves(native), strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.usefixtures("cpp_routing")  # the batching rules are the C++ backend's
def test_eager_autograd_through_row_reads_under_vmap() -> None:
    """A tensor that requires grad outside the transforms: eager autograd records the folded gather_rows and
    differentiates it (its node's backward is scatter_rows)."""
    h, index = _rows_data()
    source = h.clone().requires_grad_()
    native = torch.autograd.grad(vmap(_gathered)(source, index).sum(), source)
    with registry.use():
        got = torch.autograd.grad(vmap(_gathered)(source, index).sum(), source)
    torch.testing.assert_close(got, native)


def test_other_indices_keep_pytorchs_rules() -> None:
    """Two index tensors, an index on the second dimension, a mask: functorch's rules, inside use() too, equal to
    PyTorch's."""
    h, index = _rows_data()

    def others(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return x[j[:2], j[2:4] % WIDTH].sum() + x[:, j % WIDTH].square().sum()

    native = vmap(grad(others))(h, index)
    with registry.use():
        torch.testing.assert_close(vmap(grad(others))(h, index), native)
        torch.testing.assert_close(grad(lambda x: x[x > 0].square().sum())(h[0]), 2 * h[0].clamp(min=0))


@pytest.mark.usefixtures("cpp_routing")  # the batching rules are the C++ backend's
def test_an_index_out_of_bounds_is_pytorchs_error() -> None:
    h, index = _rows_data()
    index[2, 3] = ROWS
    with pytest.raises(IndexError, match=f"index {ROWS} is out of bounds for dimension"):  # PyTorch's: the batched one
        vmap(grad(_gathered))(h, index)
    with registry.use(), pytest.raises(IndexError, match=f"index {ROWS} is out of bounds for dimension 0 with size "
                                                        f"{ROWS}"):
        vmap(grad(_gathered))(h, index)
    index[2, 3] = -ROWS - 1  # never wraps into another sample's rows
    with registry.use(), pytest.raises(IndexError, match=f"index {-ROWS - 1} is out of bounds"):
        vmap(grad(_gathered))(h, index)


def test_the_rows_ops_refuse_what_they_do_not_take() -> None:
    ops = CPP_OPS.get()
    with pytest.raises(RuntimeError, match="int64 or int32 CPU index"):
        ops.gather_rows(torch.randn(3, 2), torch.tensor([0.0]))
    with pytest.raises(RuntimeError, match="source's leading dimensions"):
        ops.scatter_rows(torch.randn(4, 2), torch.tensor([0, 1, 2]), 3)
    with pytest.raises(RuntimeError, match="at least one dimension"):
        ops.gather_rows(torch.tensor(1.0), torch.tensor([0]))
