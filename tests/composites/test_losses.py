"""composites/losses.py: ctc_loss, pdist, multi_margin_loss and bilinear decided by their cost at the call's sizes
(the reference costs shipped with the package), and cdist's derivative kernel, each equal to the per-sample loop
outside any transform."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import func

import registry
from registry.core import cost, selector
from registry.core.context import Context
from registry.core.routing import ROUTER
from registry.store import evidence
from tests.per_sample import autograd_grad, loop

ctc_loss = torch.nn.functional.ctc_loss
pdist = torch.nn.functional.pdist


@pytest.fixture(autouse=True)
def _empty_store() -> None:
    """A new user's: nothing measured here, so the shipped reference costs decide."""
    evidence.set_entries(())
    evidence.set_profiles(())
    selector.clear_cache()


def _bucket(op: str, ctx: Context) -> dict[str, int | bool | str] | None:
    bucket = ROUTER.table.signatures.bucket(op, ctx)
    return None if bucket is None else dict(bucket)


def test_the_size_signatures_name_what_the_costs_depend_on() -> None:
    ctc = Context(stack=("vmap", "grad"), batched=("log_probs", "targets"), dtype=torch.float32, device="cpu",
                  tensors=("log_probs", "targets"), shapes=((50, 3, 20), (3, 10)), batch_size=8)
    assert _bucket("ctc_loss", ctc) == {"batch": 16, "steps": 32, "labels": 8}  # 8 x 3 samples, 50 steps, 10 labels
    unbatched = Context(stack=("vmap",), batched=("log_probs",), dtype=torch.float32, device="cpu",
                        tensors=("log_probs", "targets"), shapes=((12, 5), (4,)), batch_size=4)
    assert _bucket("ctc_loss", unbatched) == {"batch": 4, "steps": 8, "labels": 4}
    rows = Context(stack=("vmap",), batched=("self",), dtype=torch.float32, device="cpu", tensors=("self",),
                   shapes=((100, 3),), batch_size=64)
    assert _bucket("pdist", rows) == {"batch": 64, "rows": 64, "features": 2}
    assert _bucket("pdist", Context(stack=("vmap",), tensors=("self",), shapes=((5, 4, 3),), batch_size=2)) is None
    scores = Context(stack=("vmap", "grad"), batched=("self", "target"), dtype=torch.float32, device="cpu",
                     tensors=("self", "target"), shapes=((3, 10), (3,)), batch_size=20)
    assert _bucket("multi_margin_loss", scores) == {"batch": 16, "rows": 2, "classes": 8}
    one_row = Context(stack=("vmap",), batched=("self",), tensors=("self", "target"), shapes=((10,), ()),
                      batch_size=4)
    assert _bucket("multi_margin_loss", one_row) == {"batch": 4, "rows": 1, "classes": 8}
    weighted = Context(stack=("vmap",), batched=("self", "weight"), tensors=("self", "target", "weight"),
                       shapes=((10,), (), (10,)), batch_size=4)
    assert _bucket("multi_margin_loss", weighted) is None  # batched class weights: not measured, the rules decide
    layer = Context(stack=("vmap", "grad"), batched=("input1", "input2"), dtype=torch.float32, device="cpu",
                    tensors=("input1", "input2", "weight", "bias"), shapes=((2, 5, 20), (2, 5, 20), (6, 20, 20), (6,)),
                    batch_size=64)
    assert _bucket("bilinear", layer) == {"batch": 64, "rows": 8, "features": 16, "out": 4}
    ensemble = Context(stack=("vmap",), batched=("input1", "weight"), tensors=("input1", "input2", "weight"),
                       shapes=((20,), (20,), (6, 20, 20)), batch_size=4)
    assert _bucket("bilinear", ensemble) is None


def _ctc_case(batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(batch, steps, 1, 6, generator=g, dtype=torch.float64).log_softmax(-1)
    return log_probs, torch.randint(1, 6, (batch, 1, 4), generator=g)


def _ctc(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    steps = log_probs.shape[0]
    return ctc_loss(log_probs, targets, torch.tensor([steps]), torch.tensor([targets.shape[-1]]))


def test_ctc_loss_runs_pytorchs_kernel_where_the_costs_say_its_loop_is_faster() -> None:
    """Per-sample gradients of a CTC loss at batch 4: PyTorch's kernel in vmap's loop (the shipped costs time the
    composite's recursion slower at every measured size), the gradients the loop's; the reason names the ratio."""
    log_probs, targets = _ctc_case(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's performance warnings: the loop is the choice here
        with registry.use(record=True) as block:
            got = func.vmap(func.grad(_ctc))(log_probs, targets)
    decisions = [d for d in block.decisions if d.op == "ctc_loss"]
    assert [d.composite for d in decisions] == ["native"]
    assert decisions[0].reason.startswith(
        "PyTorch's own ctc_loss runs under vmap,grad at batch 4, steps 16, labels 4: correct here (vmap's "
        "per-sample loop), and functional is ")
    assert "slower than native at this size (the reference costs shipped with the package" in decisions[0].reason
    expected = loop(lambda sample: autograd_grad(lambda lp: _ctc(lp, sample[1]), sample[0]),
                    list(zip(log_probs, targets, strict=True)))
    torch.testing.assert_close(got, expected)


def test_ctc_loss_keeps_its_composite_where_native_fails() -> None:
    """Under jacfwd PyTorch's ctc_loss has no forward-AD formula: cost does not decide, the composite runs."""
    log_probs, targets = _ctc_case(1, 8)
    lp, target = log_probs[0], targets[0]
    with registry.use(record=True) as block:
        got = func.jacfwd(lambda x: _ctc(x, target))(lp)
    assert {d.composite for d in block.decisions if d.op == "ctc_loss"} == {"functional"}
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(lambda x: _ctc(x, target), lp))


def _pdist_decision(batch: int, rows: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, rows, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with registry.use(record=True) as block:
            got = func.vmap(func.grad(lambda s: pdist(s).sum()))(x)
    chosen = {d.composite for d in block.decisions if d.op == "pdist"}
    assert len(chosen) == 1
    return chosen.pop(), got, loop(lambda s: autograd_grad(lambda t: pdist(t).sum(), s), x)


def test_pdist_by_cost_at_the_sample_rows() -> None:
    """Few rows per sample at a large batch: the composite folds the batch; many rows: vmap's loop over PyTorch's
    kernel (which the shipped costs time faster there). Both equal the loop."""
    few, got, expected = _pdist_decision(256, 8)
    torch.testing.assert_close(got, expected)
    many, got, expected = _pdist_decision(4, 100)
    torch.testing.assert_close(got, expected)
    grid = cost.reference_costs().grid("pdist", ("vmap", "grad"), {})
    assert grid is not None
    assert (few, many) == ("functional", "native")


@pytest.mark.parametrize("x2_batched", [True, False])
def test_cdist_per_sample_gradients(x2_batched: bool) -> None:
    """Both inputs per sample (the four tensors of cdist's backward batched alike: PyTorch's kernel as it is) and
    one shared (the zeros that batch the others): the loop's gradients."""
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(5, 6, 3, dtype=torch.float64, generator=g)
    x2 = torch.randn(5, 4, 3, dtype=torch.float64, generator=g)
    other = x2 if x2_batched else x2[0]

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cdist(a, b).pow(3).sum()

    with registry.use():
        got = func.vmap(func.grad(loss), in_dims=(0, 0 if x2_batched else None))(x1, other)
    expected = loop(lambda pair: autograd_grad(lambda a: loss(a, pair[1]), pair[0]),
                    [(a, b if x2_batched else other) for a, b in zip(x1, x2, strict=True)])
    torch.testing.assert_close(got, expected)


def _decided(op: str, run: object) -> str:
    chosen = {d.composite for d in run.decisions if d.op == op}
    assert len(chosen) == 1
    return chosen.pop()


@pytest.mark.parametrize(("batch", "rows", "classes", "expected"), [(4, 16, 32, "native"), (256, 1, 4, "functional")])
def test_multi_margin_loss_by_cost(batch: int, rows: int, classes: int, expected: str) -> None:
    """A few samples: vmap's loop over PyTorch's kernel (the composite's dozen batched ops cost more there, in the
    shipped costs); many samples of a few classes: the composite. Per-sample gradients equal the loop either way."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(batch, rows, classes, dtype=torch.float64, generator=g)
    targets = torch.randint(0, classes, (batch, rows), generator=g)

    def loss(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.multi_margin_loss(s, t, p=2, margin=0.5)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's loop, where cost chose it
        with registry.use(record=True) as block:
            got = func.vmap(func.grad(loss))(scores, targets)
    assert _decided("multi_margin_loss", block) == expected
    torch.testing.assert_close(got, loop(lambda pair: autograd_grad(lambda s: loss(s, pair[1]), pair[0]),
                                         list(zip(scores, targets, strict=True))))


@pytest.mark.parametrize(("batch", "expected"), [(1, "native"), (64, "functional")])
def test_bilinear_per_sample_weight_gradients_by_cost(batch: int, expected: str) -> None:
    """Per-sample gradients of a bilinear layer's own weight: one sample is one call of PyTorch's kernel, faster than
    the einsum in the shipped costs; at 64 samples the einsum is. Both equal the loop."""
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(batch, 8, dtype=torch.float64, generator=g) for _ in range(2))
    weight, bias = torch.randn(4, 8, 8, dtype=torch.float64, generator=g), torch.randn(4, dtype=torch.float64)

    def loss(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.bilinear(a, b, w, bias).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with registry.use(record=True) as block:
            got = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(weight, x1, x2)
    assert _decided("bilinear", block) == expected
    torch.testing.assert_close(got, loop(lambda pair: autograd_grad(lambda w: loss(w, *pair), weight),
                                         list(zip(x1, x2, strict=True))))


@pytest.mark.parametrize(("batch", "rows", "classes", "expected"), [(4, 16, 32, "native"), (256, 1, 4, "functional")])
def test_multilabel_margin_loss_by_cost(batch: int, rows: int, classes: int, expected: str) -> None:
    """The composite's comparisons over (rows, labels, classes) cost more than vmap's loop except over many samples
    of a few classes, in the shipped costs; per-sample gradients equal the loop either way."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(batch, rows, classes, dtype=torch.float64, generator=g)
    labels = torch.randint(0, classes, (batch, rows, classes), generator=g)
    labels[..., max(classes // 4, 1):] = -1

    def loss(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.multilabel_margin_loss(s, t)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with registry.use(record=True) as block:
            got = func.vmap(func.grad(loss))(scores, labels)
    assert _decided("multilabel_margin_loss", block) == expected
    torch.testing.assert_close(got, loop(lambda pair: autograd_grad(lambda s: loss(s, pair[1]), pair[0]),
                                         list(zip(scores, labels, strict=True))))


@pytest.mark.parametrize(("batch", "rows", "expected"), [(4, 32, "native"), (256, 4, "functional")])
def test_ormqr_by_cost(batch: int, rows: int, expected: str) -> None:
    """vmap's loop over PyTorch's kernel beats the composite's reflector products except over many small samples
    (in the shipped costs); both equal the loop."""
    g = torch.Generator().manual_seed(3)
    reflectors, scales = torch.geqrf(torch.randn(batch, rows, rows, dtype=torch.float64, generator=g))
    other = torch.randn(batch, rows, 4, dtype=torch.float64, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with registry.use(record=True) as block:
            got = func.vmap(torch.ormqr)(reflectors, scales, other)
    assert _decided("ormqr", block) == expected
    torch.testing.assert_close(got, torch.stack([torch.ormqr(a, t, c) for a, t, c in zip(reflectors, scales, other,
                                                                                         strict=True)]))
