"""Per-sample weight gradients (composites/weight_gradients.py): each composite against PyTorch's own op and the
per-sample loop under the stacks it claims, and the ordinary calls that must keep PyTorch's kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import registry
from tests.composites.test_reduce import no_vmap_fallback

BATCH = 5
# nn.Linear through PyTorch's own linear, whose backward reaches mm: inside use() linear's C++ op forms the weight
# gradient with a kernel of its own instead (tests/composites/test_linear.py).
THROUGH_MM = {"linear": "native"}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _per_sample_loss(model: nn.Module):
    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x.unsqueeze(0),))  # one sample as a batch of one: mm of (1, in)
        return ((out - y) ** 2).sum()

    return loss


def _loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [name for name, _ in model.named_parameters()]
    rows = [torch.autograd.grad(((model(x[b:b + 1]) - y[b]) ** 2).sum(), list(model.parameters()))
            for b in range(x.shape[0])]
    return {name: torch.stack(column) for name, column in zip(names, zip(*rows, strict=True), strict=True)}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 6, generator=generator, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=generator, dtype=torch.float64))


def _aten_ops(run) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return {event.key for event in profile.key_averages()}


def test_linear_per_sample_gradients_equal_native_and_the_loop() -> None:
    model = _mlp()
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = _data()
    step = vmap(grad(_per_sample_loss(model)), in_dims=(None, 0, 0))
    native = step(params, x, y)
    with registry.use(), no_vmap_fallback():
        routed = step(params, x, y)
        # The weight gradients' bmm of (B, out, 1) x (B, 1, in) is gone: the outer products are multiplies.
        assert "aten::bmm" not in _aten_ops(lambda: step(params, x, y))
    assert "aten::bmm" in _aten_ops(lambda: step(params, x, y))
    loop = _loop(model, x, y)
    for name in params:
        torch.testing.assert_close(routed[name], native[name], rtol=0, atol=1e-14)
        torch.testing.assert_close(routed[name], loop[name])


def test_linear_per_sample_jacobians_equal_native_and_the_loop() -> None:
    model = _mlp()
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, _ = _data()

    def out(p: dict[str, torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xs.unsqueeze(0),)).squeeze(0)

    step = vmap(jacrev(out), in_dims=(None, 0))
    native = step(params, x)
    with registry.use(), no_vmap_fallback():
        routed = step(params, x)
    for name in params:
        torch.testing.assert_close(routed[name], native[name], rtol=0, atol=1e-14)
        loop = torch.stack([torch.func.jacrev(out)(params, x[b:b + 1].squeeze(0))[name] for b in range(BATCH)])
        torch.testing.assert_close(routed[name], loop)


@pytest.mark.parametrize("stack", ["vmap", "vmap(grad)", "vmap(jacrev)"])
def test_mm_outer_product_under_vmap(stack: str) -> None:
    """mm of a batched (n, 1) and a batched (1, m): the functional composite's outer product, called directly."""
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(BATCH, 4, 1, generator=generator, dtype=torch.float64)
    b = torch.randn(BATCH, 1, 3, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 3, generator=generator, dtype=torch.float64)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (weight * torch.mm(x, y) ** 2).sum()

    if stack == "vmap":
        f, loop = vmap(torch.mm), torch.stack([torch.mm(a[i], b[i]) for i in range(BATCH)])
    elif stack == "vmap(grad)":
        f = vmap(grad(loss, argnums=(0, 1)))
        leaves = [(a[i].clone().requires_grad_(), b[i].clone().requires_grad_()) for i in range(BATCH)]
        rows = [torch.autograd.grad(loss(ai, bi), (ai, bi)) for ai, bi in leaves]
        loop = tuple(torch.stack(column) for column in zip(*rows, strict=True))
    else:
        f = vmap(jacrev(torch.mm, argnums=(0, 1)))
        loop = tuple(torch.stack(column) for column in zip(
            *[torch.autograd.functional.jacobian(torch.mm, (a[i], b[i])) for i in range(BATCH)], strict=True))
    native = f(a, b)
    with registry.use(), no_vmap_fallback():
        routed = f(a, b)
    torch.testing.assert_close(routed, native, rtol=0, atol=1e-14)
    torch.testing.assert_close(routed, loop)


def test_mm_composite_is_pytorchs_mm_for_other_shapes() -> None:
    composite = registry.composites("mm")["functional"].fn
    a, b = torch.randn(4, 2), torch.randn(2, 3)
    assert torch.equal(composite(a, b), torch.mm(a, b))
    outer = composite(torch.randn(4, 1), torch.randn(1, 3))
    assert outer.shape == (4, 3) and outer.is_contiguous()
    with pytest.raises(RuntimeError, match="mat1 and mat2"):  # PyTorch's own error, from PyTorch's own mm
        composite(torch.randn(4, 1), torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="same dtype"):  # no silent type promotion where mm refuses
        composite(torch.randn(4, 1), torch.randn(1, 3, dtype=torch.float64))


@pytest.mark.parametrize(("stack", "batched"), [
    ("vmap,grad", ("self",)),        # the forward of a per-sample step: activations times a shared weight
    ("vmap,grad", ("mat2",)),
    ("vmap", ("self",)),
    ("grad", ()),                    # no vmap: nothing per sample
    ("autograd", ()),
])
def test_ordinary_mm_keeps_pytorchs_kernel(stack: str, batched: tuple[str, ...]) -> None:
    """Where the call cannot be a per-sample weight gradient the decision is native, which the routing kernels
    pass to PyTorch's own kernel without calling back into Python."""
    decision = registry.select("mm", stack=stack, batched=list(batched))
    assert (decision.composite, decision.kind) == ("native", "native")


def test_per_sample_products_choose_the_composite() -> None:
    decision = registry.select("mm", stack="vmap,grad", batched=["self", "mat2"])
    assert decision.kind == "functional"
    assert "per-sample weight gradient" in decision.reason


def test_the_composite_runs_only_where_both_factors_are_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    """At run time: an ordinary forward under vmap (activations times a shared weight) never enters the Python
    composite; the per-sample step's weight gradients do."""
    from composites import weight_gradients

    entered: list[tuple[int, ...]] = []
    real = weight_gradients._contracts_one

    def counting(a: torch.Tensor, b: torch.Tensor) -> bool:
        entered.append((*a.shape, *b.shape))
        return real(a, b)

    monkeypatch.setattr(weight_gradients, "_contracts_one", counting)
    model = _mlp()
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = _data()
    weight = torch.randn(6, 4, dtype=torch.float64)
    with registry.use(pins=THROUGH_MM):
        vmap(lambda row: torch.mm(row.unsqueeze(0), weight))(x)
        vmap(lambda p, xs: functional_call(model, p, (xs.unsqueeze(0),)), in_dims=(None, 0))(params, x)
    assert entered == []
    with registry.use(pins=THROUGH_MM):
        vmap(grad(_per_sample_loss(model)), in_dims=(None, 0, 0))(params, x, y)
    assert sorted(entered) == [(3, 1, 1, 7), (7, 1, 1, 6)]  # the two weight gradients, (out, 1) x (1, in)


def test_products_over_more_than_one_element_keep_pytorchs_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-sample step over sequences (each sample a (3, in) matrix, as attention's projections see it): both
    factors of each weight gradient are batched, but the contraction is over the 3 positions, so the decision is
    native and the Python composite is never entered; the gradients equal the loop's."""
    from composites import weight_gradients

    entered: list[tuple[int, ...]] = []
    real = weight_gradients._contracts_one

    def counting(a: torch.Tensor, b: torch.Tensor) -> bool:
        entered.append((*a.shape, *b.shape))
        return real(a, b)

    monkeypatch.setattr(weight_gradients, "_contracts_one", counting)
    model = _mlp()
    params = {name: p.detach() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 3, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, 3, 3, generator=generator, dtype=torch.float64)

    def loss(p: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (xs,)) - ys) ** 2).sum()

    with no_vmap_fallback(), registry.use(pins=THROUGH_MM, record=True) as run:
        got = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    assert entered == []
    assert {d.composite for d in run.decisions if d.op == "mm"} == {"native"}
    rows = [torch.autograd.grad(((model(x[b]) - y[b]) ** 2).sum(), list(model.parameters())) for b in range(BATCH)]
    for (name, _), column in zip(model.named_parameters(), zip(*rows, strict=True), strict=True):
        torch.testing.assert_close(got[name], torch.stack(column))
