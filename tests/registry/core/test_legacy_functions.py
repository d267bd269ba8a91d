"""Pre-2.0 autograd.Functions (``forward(ctx, ...)``, no ``setup_context``) under torch.func transforms inside use().

Each Function below is written the old way. Outside use() every transform refuses it (PyTorch's setup_context
error); inside use() it runs under vmap, grad, vmap(grad), jacrev and jacfwd, and equals a per-sample loop of
torch.autograd outside any transform, values and gradients, in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import func
from torch.autograd.function import once_differentiable

import registry
from registry.core import legacy_functions

pytestmark = pytest.mark.usefixtures("routing_backend")

SETUP_CONTEXT_REFUSAL = "it must override the setup_context"


# --- the suite, written the old way ---------------------------------------------------------------------------------

class SaveInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class SaveOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


class ScaledRowSum(torch.autograd.Function):
    """Non-tensor ctx attributes (a float argument, a shape) and a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        ctx.shape = x.shape
        return x.sum(0) * factor

    @staticmethod
    def backward(ctx, grad):
        return grad.expand(ctx.shape) * ctx.factor, None


class NeedsInputGrad(torch.autograd.Function):
    """Returns a gradient only where ``ctx.needs_input_grad`` asks (y is a constant here)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y.sin()

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        grad_x = grad * y.sin() if ctx.needs_input_grad[0] else None
        grad_y = grad * x * y.cos() if ctx.needs_input_grad[1] else None
        return grad_x, grad_y


class SortValues(torch.autograd.Function):
    """Two outputs, the indices marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, index = x.sort()
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        return values, index

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_values, grad_index):
        (index,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, index, grad_values)


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class SinCos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, grad_sin, grad_cos):
        (x,) = ctx.saved_tensors
        return grad_sin * x.cos() - grad_cos * x.sin()


class TanhIntermediate(torch.autograd.Function):
    """Keeps an intermediate, once saved and once as a tensor attribute on ctx."""

    @staticmethod
    def forward(ctx, x, w):
        h = x.tanh()
        ctx.save_for_backward(w)
        ctx.h = h
        return h * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * w * (1 - ctx.h * ctx.h), grad * ctx.h


class NumpySin(torch.autograd.Function):
    """Not batchable: forward and backward go through NumPy."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.from_numpy(np.sin(x.detach().numpy()))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.from_numpy(np.cos(x.detach().numpy()))


class WithJvp(torch.autograd.Function):
    """Defines jvp: forward-mode AD uses it (adapted) instead of differentiating the forward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        ctx.save_for_backward(x)
        return x.sinh()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cosh()

    @staticmethod
    def jvp(ctx, tangent):
        (x,) = ctx.saved_tensors
        return tangent * x.cosh()


# --- realistic ones, modelled on scientific libraries ---------------------------------------------------------------

CENTERS = torch.linspace(0.0, 2.0, 5, dtype=torch.float64)


class GaussianRadialBasis(torch.autograd.Function):
    """An equivariant-network library's radial basis of edge lengths, with a hand-written backward."""

    @staticmethod
    def forward(ctx, r, centers, gamma):
        diff = r[..., None] - centers
        y = torch.exp(-gamma * diff * diff)
        ctx.save_for_backward(diff, y)
        ctx.gamma = gamma
        return y

    @staticmethod
    def backward(ctx, grad):
        diff, y = ctx.saved_tensors
        return (grad * y * (-2 * ctx.gamma) * diff).sum(-1), None, None


class UncheckedAssign(torch.autograd.Function):
    """An ODE solver's adaptive step writes each stage into a scratch buffer past the version counter."""

    @staticmethod
    def forward(ctx, scratch, value, index):
        ctx.index = index
        scratch.data[index] = value
        return scratch

    @staticmethod
    def backward(ctx, grad_scratch):
        return grad_scratch, grad_scratch[ctx.index], None


def sq_dist(x1, x2):
    return (x1[:, None, :] - x2[None, :, :]).pow(2).sum(-1)


class RBFCovariance(torch.autograd.Function):
    """A Gaussian-process library's default kernel: distances in forward, a gradient for the lengthscale only."""

    @staticmethod
    def forward(ctx, x1, x2, lengthscale, sq_dist_func):
        if any(ctx.needs_input_grad[:2]):
            raise RuntimeError("RBFCovariance cannot compute gradients with respect to x1 and x2")
        needs_grad = any(ctx.needs_input_grad)
        unitless_sq_dist = sq_dist_func(x1.div(lengthscale), x2.div(lengthscale))
        unitless_sq_dist_ = unitless_sq_dist.clone() if needs_grad else unitless_sq_dist
        covar_mat = unitless_sq_dist_.div_(-2.0).exp_()
        if needs_grad:
            d_output_d_input = unitless_sq_dist.mul_(covar_mat).div_(lengthscale)
            ctx.save_for_backward(d_output_d_input)
        return covar_mat

    @staticmethod
    def backward(ctx, grad_output):
        (d_output_d_input,) = ctx.saved_tensors
        return None, None, grad_output * d_output_d_input, None


# --- cases: a per-sample function of one tensor, built on each Function ---------------------------------------------

W = torch.tensor([0.5, -1.5, 2.0, 0.25], dtype=torch.float64)
POINTS = torch.tensor([[0.0, 1.0], [1.0, 0.5], [-0.5, 2.0]], dtype=torch.float64)


def assign_stages(x: torch.Tensor) -> torch.Tensor:
    scratch = x.new_zeros(3, 4)
    for stage in range(3):
        scratch = UncheckedAssign.apply(scratch, x * (stage + 1), stage)
    return scratch * W


CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "save_input": SaveInput.apply,
    "save_output": SaveOutput.apply,
    "non_tensor_attributes": lambda x: ScaledRowSum.apply(x.reshape(2, 2), 1.5),
    "needs_input_grad": lambda x: NeedsInputGrad.apply(x, W),
    "mark_non_differentiable": lambda x: SortValues.apply(x)[0] * W,
    "once_differentiable": OnceDifferentiable.apply,
    "mark_dirty": lambda x: DoubleInPlace.apply(x * 1.0) * W,
    "several_outputs": lambda x: SinCos.apply(x)[0] * SinCos.apply(x)[1] + SinCos.apply(x * W)[1],
    "saved_intermediate": lambda x: TanhIntermediate.apply(x, W),
    "not_batchable": NumpySin.apply,
    "with_jvp": WithJvp.apply,
    "radial_basis": lambda x: GaussianRadialBasis.apply(x.abs(), CENTERS, 1.5),
    "ode_stage_assignment": assign_stages,
    "gp_rbf_lengthscale": lambda x: RBFCovariance.apply(POINTS, POINTS, x[:1].exp().reshape(1, 1), sq_dist),
}
# Forward-mode AD needs a jvp or a forward whose ops are differentiable: NumPy's are not, nor a write through .data.
NO_FORWARD_MODE = {"not_batchable", "ode_stage_assignment"}
# A backward that is not batchable, under vmap(grad): it runs at the gradient level, above the vmap, batched.
NO_VMAP_GRAD = {"not_batchable"}
BATCH = torch.tensor([[0.3, -1.2, 0.8, 2.0], [1.1, 0.4, -0.7, 0.2], [-0.5, 0.9, 1.6, -1.3]], dtype=torch.float64)


def loss_of(case: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: case(x).sin().sum()


def loop_values(case: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    return torch.stack([case(x.clone()) for x in batch])


def loop_grads(case: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    grads = []
    for x in batch:
        x = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(loss_of(case)(x), x)[0])
    return torch.stack(grads)


def loop_jacobian(case: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    out = case(x).reshape(-1)
    rows = [torch.autograd.grad(out[i], x, retain_graph=True)[0] for i in range(out.numel())]
    return torch.stack(rows).reshape(*case(x.detach()).shape, *x.shape)


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_refuses_outside_use(name: str) -> None:
    with pytest.raises(RuntimeError, match=SETUP_CONTEXT_REFUSAL):
        func.vmap(CASES[name])(BATCH.clone())
    with pytest.raises(RuntimeError, match=SETUP_CONTEXT_REFUSAL):
        func.grad(loss_of(CASES[name]))(BATCH[0].clone())


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_and_vmap_grad_equal_the_loop(name: str) -> None:
    case = CASES[name]
    if name in NO_VMAP_GRAD:
        with registry.use(), pytest.raises(legacy_functions.LegacyFunctionError, match="cannot be looped"):
            func.vmap(func.grad(loss_of(case)))(BATCH.clone())
        return
    with registry.use():
        values = func.vmap(case)(BATCH.clone())
        grads = func.vmap(func.grad(loss_of(case)))(BATCH.clone())
        one = func.grad(loss_of(case))(BATCH[1].clone())
    torch.testing.assert_close(values, loop_values(case, BATCH))
    torch.testing.assert_close(grads, loop_grads(case, BATCH))
    torch.testing.assert_close(one, loop_grads(case, BATCH[1:2])[0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_jacobians_equal_the_loop(name: str) -> None:
    case = CASES[name]
    x = BATCH[0].clone()
    expected = loop_jacobian(case, x)
    with registry.use():
        torch.testing.assert_close(func.jacrev(case)(x.clone()), expected)
        if name not in NO_FORWARD_MODE:
            torch.testing.assert_close(func.jacfwd(case)(x.clone()), expected)
        else:  # not a silently wrong tangent: an error that says why
            with pytest.raises(legacy_functions.LegacyFunctionError, match="needs a jvp"):
                func.jacfwd(case)(x.clone())


def test_hessian_through_a_once_differentiable_backward() -> None:
    """hessian = jacfwd(jacrev): forward mode on the stack and no jvp, so the forward's ops are differentiated."""
    f = loss_of(OnceDifferentiable.apply)
    x = BATCH[0].clone()
    expected = torch.autograd.functional.hessian(lambda v: v.sin().sin().sum(), x)
    with registry.use():
        torch.testing.assert_close(func.hessian(f)(x), expected)
        torch.testing.assert_close(func.jacrev(func.grad(f))(x), expected)
    chosen = {(d.function, d.stack): d.composite for d in legacy_functions.decisions()}
    assert chosen[("OnceDifferentiable", "vmap(jvp(grad))")] == "autograd"
    assert chosen[("OnceDifferentiable", "grad(grad)")] == "autograd"


def test_the_choice_follows_the_stack() -> None:
    x = BATCH[0].clone()
    with registry.use():
        func.grad(loss_of(SaveInput.apply))(x)
        func.jacfwd(SaveInput.apply)(x)
        func.jacfwd(WithJvp.apply)(x)
    chosen = {(d.function, d.stack): d for d in legacy_functions.decisions()}
    assert chosen[("SaveInput", "grad")].composite == "adapted"
    assert chosen[("SaveInput", "vmap(jvp)")].composite == "autograd"
    assert "defines no jvp" in chosen[("SaveInput", "vmap(jvp)")].reason
    assert chosen[("WithJvp", "vmap(jvp)")].composite == "adapted"


def test_not_batchable_loops_under_vmap() -> None:
    """A forward through NumPy runs once per sample under vmap (jacrev, in test_jacobians_equal_the_loop, loops its
    backward over the cotangents); a backward through NumPy at a gradient level cannot run (functorch's wrappers
    have no storage there, natively too): a clear error."""
    with registry.use():
        values = func.vmap(NumpySin.apply)(BATCH.clone())
        with pytest.raises(legacy_functions.LegacyFunctionError, match="cannot be looped"):
            func.grad(lambda x: func.vmap(NumpySin.apply)(x).sin().sum())(BATCH.clone())
    torch.testing.assert_close(values, BATCH.sin())


def test_gp_ensemble_of_lengthscales() -> None:
    """vmap over an ensemble of lengthscales, the gradient of each GP's kernel sum (grad of a sum over the batch)."""
    lengthscales = torch.tensor([[0.5], [1.0], [2.0]], dtype=torch.float64)

    def kernel_sum(ls: torch.Tensor) -> torch.Tensor:
        return RBFCovariance.apply(POINTS, POINTS, ls.reshape(1, 1), sq_dist).sum()

    with registry.use():
        grads = func.grad(lambda ls: func.vmap(kernel_sum)(ls).sum())(lengthscales.clone())
    leaf = lengthscales.clone().requires_grad_()
    expected = torch.autograd.grad(torch.stack([kernel_sum(ls) for ls in leaf]).sum(), leaf)[0]
    torch.testing.assert_close(grads, expected)


def test_per_sample_ctx_values_under_a_gradient_inside_vmap_raise_clearly() -> None:
    """Looping over the samples, a forward that keeps a per-sample Python value on ctx cannot have one ctx replayed
    for the batch by a gradient level inside the vmap: a clear error, not a wrong value."""

    class MaxNormalize(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.m = x.abs().max().item()
            return x / ctx.m

        @staticmethod
        def backward(ctx, grad):
            return grad / ctx.m

    with registry.use():
        torch.testing.assert_close(func.vmap(MaxNormalize.apply)(BATCH.clone()),
                                   torch.stack([x / x.abs().max() for x in BATCH]))
        with pytest.raises(legacy_functions.LegacyFunctionError, match="differ between samples"):
            func.vmap(func.grad(loss_of(MaxNormalize.apply)))(BATCH.clone())


def test_outside_use_the_patch_is_pytorchs_apply() -> None:
    with registry.use():
        pass
    x = BATCH[0].clone().requires_grad_()
    SaveInput.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)
    with registry.use(policy="native"), pytest.raises(RuntimeError, match=SETUP_CONTEXT_REFUSAL):
        func.grad(loss_of(SaveInput.apply))(BATCH[0].clone())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_custom_ops_pre_2_0_autograd_kernel(reduction: str) -> None:
    """PyTorch's chunked ``linear_cross_entropy`` is a torch.library custom op whose autograd kernel applies a pre-2.0
    Function from inside the dispatcher: natively every reverse-mode transform refuses it; inside use() it records
    as an autograd node at the level being processed, and equals the unchunked loss."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64, generator=generator)
    weight = torch.randn(10, 8, dtype=torch.float64, generator=generator)
    target = torch.randint(0, 10, (6,), generator=generator)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=reduction != "none")

    def chunked(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear_cross_entropy(x, w, target, reduction=reduction, options=options).sum()

    def reference(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x @ w.T, target, reduction=reduction).sum()

    ensemble = torch.stack([weight, weight * 0.5, -weight])
    with pytest.raises(RuntimeError, match=SETUP_CONTEXT_REFUSAL):
        func.grad(chunked)(weight)
    with registry.use():
        torch.testing.assert_close(func.grad(chunked)(weight), func.grad(reference)(weight))
        torch.testing.assert_close(func.vmap(func.grad(chunked))(ensemble), func.vmap(func.grad(reference))(ensemble))
        torch.testing.assert_close(func.jacrev(chunked)(weight), func.jacrev(reference)(weight))
    chosen = {d.stack: d.composite for d in legacy_functions.decisions() if "linear_cross_entropy" in d.function}
    assert chosen["grad"] == "autograd kernel"
