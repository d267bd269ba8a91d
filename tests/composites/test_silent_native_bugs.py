"""Where PyTorch 2.13 returns wrong values or wrong shapes under a transform without raising (found by
``multicomposite survey --limit-samples 25``), ``use()`` returns what a per-sample loop outside any transform returns.

Each test first checks that native PyTorch really is wrong there, so it documents the bug: on torch 2.13 a native
that agrees fails the test (the rule routing around it would be wrong); on a later torch that fixed it the test
skips, saying which rule can go."""

from __future__ import annotations

import pytest
import torch
from torch import func

import registry

PINNED = "2.13"


def _native_is_wrong(wrong: bool, what: str) -> None:
    if wrong:
        return
    if torch.__version__.startswith(PINNED):
        raise AssertionError(f"{what}: native PyTorch {torch.__version__} is right here, the rule routing around it "
                             "is not")
    pytest.skip(f"{what}: fixed in PyTorch {torch.__version__}; the rule routing around it can go")


def _loop(fn, *batched: torch.Tensor) -> torch.Tensor:
    return torch.stack([fn(*values) for values in zip(*batched, strict=True)])


def _grad_loop(loss, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per sample, torch.autograd.grad of ``loss(value, weight)`` with respect to the value: outside any transform."""
    grads = []
    for value, weight in zip(values, weights, strict=True):
        leaf = value.detach().clone().requires_grad_()
        grads.append(torch.autograd.grad(loss(leaf, weight), leaf)[0])
    return torch.stack(grads)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.shape == expected.shape and torch.allclose(actual, expected)


# --- roll of a 0-d sample with dims empty: vmap rolls across the batch --------------------------------------------


def _roll(x: torch.Tensor) -> torch.Tensor:
    return torch.roll(x, 10)


SCALARS = torch.tensor([1.0, -2.0, 3.5], dtype=torch.float64)


def test_roll_under_vmap() -> None:
    expected = _loop(_roll, SCALARS)
    assert torch.equal(expected, SCALARS)  # a 0-d tensor rolled is itself
    _native_is_wrong(not torch.equal(func.vmap(_roll)(SCALARS), expected), "roll under vmap")
    with registry.use():
        assert torch.equal(func.vmap(_roll)(SCALARS), expected)


def test_roll_under_vmap_of_jvp_and_vmap_of_grad() -> None:
    tangents = torch.tensor([0.5, 0.25, -1.0], dtype=torch.float64)
    expected = torch.stack([torch.stack(func.jvp(_roll, (x,), (t,))) for x, t in zip(SCALARS, tangents, strict=True)])

    def per_sample_jvp(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(func.jvp(_roll, (x,), (t,)))

    _native_is_wrong(not torch.equal(func.vmap(per_sample_jvp)(SCALARS, tangents), expected), "roll under vmap(jvp)")
    weights = torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64)

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * _roll(x)

    with registry.use():
        assert torch.equal(func.vmap(per_sample_jvp)(SCALARS, tangents), expected)
        grads = func.vmap(func.grad(loss))(SCALARS, weights)
    assert torch.equal(grads, _grad_loop(loss, SCALARS, weights))


# --- linalg.pinv of an empty matrix, vmapped over rtol: the batch dimension is dropped ------------------------------


EMPTY = torch.zeros(0, 0, dtype=torch.float64)
TOLERANCES = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)


def _pinv(matrix: torch.Tensor, rtol: torch.Tensor) -> torch.Tensor:
    return torch.linalg.pinv(matrix, rtol=rtol)


def test_pinv_of_an_empty_matrix_under_vmap_over_rtol() -> None:
    expected = _loop(lambda rtol: _pinv(EMPTY, rtol), TOLERANCES)
    assert expected.shape == (3, 0, 0)
    native = func.vmap(lambda rtol: _pinv(EMPTY, rtol))(TOLERANCES)
    _native_is_wrong(native.shape != expected.shape, "linalg.pinv of an empty matrix under vmap over rtol")
    with registry.use():
        used = func.vmap(lambda rtol: _pinv(EMPTY, rtol))(TOLERANCES)
        grads = func.vmap(func.grad(lambda matrix, rtol: _pinv(matrix, rtol).sum()), in_dims=(None, 0))(
            EMPTY, TOLERANCES)
    assert used.shape == expected.shape == (3, 0, 0)
    assert grads.shape == (3, 0, 0)  # per sample, the gradient of an empty matrix
    # Non-empty matrices still go through PyTorch's pinv: the same values as the loop.
    matrices = torch.randn(3, 4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with registry.use():
        assert _close(func.vmap(_pinv)(matrices, TOLERANCES), _loop(_pinv, matrices, TOLERANCES))


# --- cdist under jacrev: _cdist_backward's batching rule, with only the cotangent batched ----------------------------


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0, float("inf")])
def test_cdist_jacobians_under_jacrev(p: float) -> None:
    generator = torch.Generator().manual_seed(0)
    x1 = torch.randn(3, 5, dtype=torch.float64, generator=generator)
    x2 = torch.randn(4, 5, dtype=torch.float64, generator=generator)

    def distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cdist(a, b, p=p)

    # The loop: one autograd.grad per output element, outside any transform.
    expected = torch.autograd.functional.jacobian(distances, (x1, x2))
    native = func.jacrev(distances, argnums=(0, 1))(x1, x2)
    _native_is_wrong(not all(_close(n, e) for n, e in zip(native, expected, strict=True)),
                     f"cdist p={p} under jacrev")
    weights = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator)

    def loss(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w * distances(a, x2)).sum()

    with registry.use():
        used = func.jacrev(distances, argnums=(0, 1))(x1, x2)
        # vmap(grad), where PyTorch's batching rule was already right, stays right.
        per_sample = func.vmap(func.grad(loss), in_dims=(None, 0))(x1, weights)
    for u, e in zip(used, expected, strict=True):
        assert _close(u, e)
    assert _close(per_sample, _grad_loop(loss, x1.expand(2, 3, 5), weights))


# --- meta-learning through batch norm in training mode: grad(vmap(grad)) --------------------------------------------


class _ConvNet(torch.nn.Module):
    """conv -> batch_norm (training, no running statistics) -> relu -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3, track_running_stats=False)
        self.fc = torch.nn.Linear(3 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_meta_gradient_through_batch_norm() -> None:
    """MAML: each task takes an inner gradient step through batch norm; the meta-gradient is grad over the tasks'
    vmap. Native 2.13's batching rule of native_batch_norm_backward loses the input's dependence through the saved
    statistics when an outer grad differentiates it (conv weight gradients off by about 1e-2 in float64)."""
    torch.manual_seed(0)
    net = _ConvNet().double()
    params = {name: p.detach() for name, p in net.named_parameters()}
    xs, ys = torch.randn(3, 4, 1, 6, 6, dtype=torch.float64), torch.randn(3, 4, 2, dtype=torch.float64)

    def task_loss(p, x, y):
        def inner(q):
            return ((func.functional_call(net, q, (x,)) - y) ** 2).mean()

        step = func.grad(inner)(p)
        return inner({name: p[name] - 0.1 * step[name] for name in p})

    def meta(p):
        return func.vmap(task_loss, in_dims=(None, 0, 0))(p, xs, ys).sum()

    expected = func.grad(lambda p: sum(task_loss(p, xs[i], ys[i]) for i in range(3)))(params)
    native = func.grad(meta)(params)
    _native_is_wrong(not _close(native["conv.weight"], expected["conv.weight"]), "grad(vmap(grad)) through batch norm")
    with registry.use():
        got = func.grad(meta)(params)
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-12, atol=1e-12), name


def test_jacobian_of_vmapped_weight_gradients_through_batch_norm() -> None:
    """jacrev(vmap(grad)): the Jacobian with respect to each task's input of its gradient with respect to a shared
    batch-norm weight (the same batching rule: off by about 0.9 natively)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 3, 2, 2, dtype=torch.float64)
    weight, bias = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    scale = torch.randn(4, 3, 2, 2, dtype=torch.float64)

    def weight_grad(v: torch.Tensor) -> torch.Tensor:
        return func.grad(lambda w: (torch.sin(torch.nn.functional.batch_norm(v, None, None, w, bias, training=True))
                                    * scale).sum())(weight)

    expected = torch.autograd.functional.jacobian(lambda b: torch.stack([weight_grad(v) for v in b]), x)
    native = func.jacrev(func.vmap(weight_grad))(x)
    _native_is_wrong(not _close(native, expected), "jacrev(vmap(grad)) through batch norm")
    with registry.use():
        got = func.jacrev(func.vmap(weight_grad))(x)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)


# --- layer norm with a bias and no weight: the bias gradient is not differentiable again ---------------------------

LAYER_X = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
LAYER_BIAS = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
ONES = torch.ones(5, dtype=torch.float64)


def _layer_loss(weight: torch.Tensor | None):
    def loss(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.layer_norm(x, (5,), weight, bias) ** 3).sum()

    return loss


def _second_derivatives(weight: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The bias's second derivatives through layer norm, by grad(grad), grad(vmap(grad)), jacrev(jacrev) and eager
    double backward (weight None: the bug; weight ones: PyTorch's own op with its correct formula, the reference)."""
    loss = _layer_loss(weight)
    inner = func.grad(loss)
    leaf = LAYER_BIAS.clone().requires_grad_()
    (first,) = torch.autograd.grad(loss(leaf, LAYER_X), leaf, create_graph=True)
    (eager,) = torch.autograd.grad(first.pow(2).sum(), leaf, allow_unused=True, materialize_grads=True)
    return {
        "grad(grad)": func.grad(lambda b: inner(b, LAYER_X).pow(2).sum())(LAYER_BIAS),
        "grad(vmap(grad))": func.grad(lambda b: func.vmap(inner, in_dims=(None, 0))(b, LAYER_X).pow(2).sum())(
            LAYER_BIAS),
        "jacrev(jacrev)": func.jacrev(func.jacrev(loss))(LAYER_BIAS, LAYER_X),
        "eager": eager,
    }


def test_second_derivatives_of_layer_norm_with_a_bias_and_no_weight() -> None:
    expected = _second_derivatives(ONES)
    native = _second_derivatives(None)
    _native_is_wrong(not torch.equal(native["grad(grad)"], expected["grad(grad)"]), "grad(grad) of layer norm's bias")
    assert torch.count_nonzero(native["grad(grad)"]) == 0  # silently zero, not an error
    assert torch.count_nonzero(native["eager"]) == 0
    with registry.use():
        got = _second_derivatives(None)
    for stack, wanted in expected.items():
        assert torch.count_nonzero(wanted) > 0, stack
        torch.testing.assert_close(got[stack], wanted, rtol=1e-12, atol=1e-12, msg=stack)


def _layer_norm_choices(run) -> set[str]:
    return {decision.composite for decision in run.decisions if decision.op == "native_layer_norm"}


def test_layer_norm_per_sample_gradients_keep_pytorchs_kernel() -> None:
    """One level of differentiation (vmap(grad)) is right natively: PyTorch's kernel runs there; with a weight, too."""
    with registry.use(record=True) as first_order:
        got = func.vmap(func.grad(_layer_loss(None)), in_dims=(None, 0))(LAYER_BIAS, LAYER_X)
    with registry.use(record=True) as with_weight:
        func.grad(lambda b: func.grad(_layer_loss(ONES))(b, LAYER_X).pow(2).sum())(LAYER_BIAS)
    with registry.use(record=True) as second_order:
        func.grad(lambda b: func.grad(_layer_loss(None))(b, LAYER_X).pow(2).sum())(LAYER_BIAS)
    torch.testing.assert_close(got, func.vmap(func.grad(_layer_loss(None)), in_dims=(None, 0))(LAYER_BIAS, LAYER_X),
                               rtol=0, atol=0)
    assert _layer_norm_choices(first_order) == {"native"}
    assert _layer_norm_choices(with_weight) == {"native"}
    assert _layer_norm_choices(second_order) == {"bias_added"}


def test_layer_norm_composite_refuses_the_bias_pytorch_refuses() -> None:
    """A bias that the add would broadcast (one element) raises PyTorch's error inside use() too."""
    def loss(bias: torch.Tensor) -> torch.Tensor:
        return torch.native_layer_norm(LAYER_X, (5,), None, bias, 1e-5)[0].sum()

    one = torch.ones(1, dtype=torch.float64)
    message = "Expected bias to be of same shape as normalized_shape"
    with pytest.raises(RuntimeError, match=message):
        func.grad(loss)(one)
    with registry.use(pins={"native_layer_norm": "bias_added"}), pytest.raises(RuntimeError, match=message):
        func.grad(loss)(one)
