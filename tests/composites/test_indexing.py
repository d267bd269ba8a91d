"""The flat-index family (composites/indexing.py): what the generic OpInfo test cannot see."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling
from torch.func import grad, vmap

import registry
from tests.composites.test_reduce import no_vmap_fallback

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
    rows = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    with no_vmap_fallback():
        found = vmap(lambda row: torch.nonzero_static(row, size=3, fill_value=-5))(rows)
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
