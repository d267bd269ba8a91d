"""grad's backward without ``create_graph`` (``registry/core/first_order_grad.py``): inside ``use()`` on the C++
backend, exactly where nothing can differentiate its result again (only vmap levels below grad, nothing that
requires grad below the wrappers, only built-in nodes without hooks); everywhere else as PyTorch runs it, and the
gradients of the gradients equal PyTorch's."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import func
from torch.utils._pytree import tree_leaves  # noqa: PLC2701 - PyTorch's pytree

import registry
from registry.core import first_order_grad

pytestmark = pytest.mark.usefixtures("routing_backend")

SAMPLES, FEATURES, OUT = 5, 3, 4


@pytest.fixture
def create_graph_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """The ``create_graph`` of every backward grad runs: each call of functorch's ``_autograd_grad`` that grad makes
    (the patch's callee), and False for each one engine call serves (``first_order_backward``)."""
    registry.install()
    seen: list[bool] = []
    pytorchs = first_order_grad.PYTORCH_AUTOGRAD_GRAD

    def spy(outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: bool = False,
            create_graph: bool = True) -> Any:
        if grad_outputs is None:  # grad's call; vjp's carry cotangents
            seen.append(create_graph)
        return pytorchs(outputs, inputs, grad_outputs, retain_graph, create_graph)

    def engine_spy(outputs: Any, inputs: Any, below_grad: Any = None) -> Any:
        grads = engine_call(outputs, inputs, below_grad)
        if grads is not None:  # served by one engine call, without create_graph
            seen.append(False)
        return grads

    engine_call = first_order_grad.first_order_backward
    monkeypatch.setattr(first_order_grad, "PYTORCH_AUTOGRAD_GRAD", spy)
    monkeypatch.setattr(first_order_grad, "first_order_backward", engine_spy)
    yield seen


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(OUT, FEATURES, dtype=torch.float64, generator=generator),
            torch.randn(SAMPLES, FEATURES, dtype=torch.float64, generator=generator))


def _loss(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weight.T).pow(2).sum()


def _per_sample(loss: Callable[..., torch.Tensor] = _loss) -> Callable[..., torch.Tensor]:
    return func.vmap(func.grad(loss), in_dims=(None, 0))


def _first_order(backend: str) -> bool:
    """What create_graph grad gets where nothing differentiates again: False on the C++ backend only."""
    return backend != "cpp"


def test_per_sample_gradients_without_create_graph(create_graph_seen: list[bool], routing_backend: str) -> None:
    weight, x = _inputs()
    loop = torch.stack([torch.func.grad(_loss)(weight, sample) for sample in x])
    create_graph_seen.clear()
    with registry.use():
        got = _per_sample()(weight, x)
    assert create_graph_seen == [_first_order(routing_backend)]
    torch.testing.assert_close(got, loop)
    assert not got.requires_grad


@pytest.mark.parametrize("stack", ("grad", "vmap(vmap(grad))"))
def test_only_vmap_levels_below(create_graph_seen: list[bool], routing_backend: str, stack: str) -> None:
    weight, x = _inputs()
    run = (lambda: func.grad(_loss)(weight, x)) if stack == "grad" else (
        lambda: func.vmap(_per_sample(), in_dims=(None, 0))(weight, x.expand(2, *x.shape)))
    expected = run()
    create_graph_seen.clear()
    with registry.use():
        got = run()
    assert create_graph_seen == [_first_order(routing_backend)]
    torch.testing.assert_close(got, expected)


def test_outside_use_grad_keeps_create_graph(create_graph_seen: list[bool]) -> None:
    weight, x = _inputs()
    _per_sample()(weight, x)
    assert create_graph_seen == [True]


def test_a_level_that_differentiates_again_keeps_it(create_graph_seen: list[bool], routing_backend: str) -> None:
    """grad(vmap(grad)): the inner grad keeps create_graph (the outer grad differentiates its result); the outer one
    has nothing below it."""
    weight, x = _inputs()

    def outer(w: torch.Tensor) -> torch.Tensor:
        return _per_sample()(w, x).pow(2).sum()

    expected = func.grad(outer)(weight)
    create_graph_seen.clear()
    with registry.use():
        got = func.grad(outer)(weight)
    assert create_graph_seen == [True, _first_order(routing_backend)]
    torch.testing.assert_close(got, expected)


def test_jvp_below_keeps_it(create_graph_seen: list[bool]) -> None:
    weight, x = _inputs()
    run = func.vmap(func.jacfwd(func.grad(_loss)), in_dims=(None, 0))
    expected = run(weight, x)
    create_graph_seen.clear()
    with registry.use():
        got = run(weight, x)
    assert create_graph_seen == [True]
    torch.testing.assert_close(got, expected)


def _eager_second_derivative(run: Callable[[torch.Tensor], torch.Tensor], leaf: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                        ...]:
    per_sample = run(leaf)
    return per_sample, *torch.autograd.grad(per_sample.pow(2).sum(), leaf)


@pytest.mark.parametrize("captured", (False, True), ids=("passed", "captured"))
def test_eager_autograd_below_keeps_it(create_graph_seen: list[bool], captured: bool) -> None:
    """A weight that requires grad, passed to the transform or captured by the function: eager autograd records the
    forward, so the per-sample gradients are differentiated through, as natively."""
    weight, x = _inputs()
    leaf = weight.clone().requires_grad_()

    def run(w: torch.Tensor) -> torch.Tensor:
        if captured:
            return func.vmap(func.grad(lambda sample: _loss(w, sample)))(x)
        return _per_sample()(w, x)

    expected = _eager_second_derivative(run, leaf)
    create_graph_seen.clear()
    with registry.use():
        got = _eager_second_derivative(run, leaf)
    assert create_graph_seen == [True]
    torch.testing.assert_close(got, expected)


def test_under_no_grad_nothing_records(create_graph_seen: list[bool], routing_backend: str) -> None:
    """Under torch.no_grad() eager autograd records nothing, even of a weight that requires grad."""
    weight, x = _inputs()
    leaf = weight.clone().requires_grad_()
    with torch.no_grad():
        expected = _per_sample()(leaf, x)
        create_graph_seen.clear()
        with registry.use():
            got = _per_sample()(leaf, x)
    assert create_graph_seen == [_first_order(routing_backend)]
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad and not expected.requires_grad


class _ScaledByCaptured(torch.autograd.Function):
    """Forward the identity; backward scales by a tensor the forward never touched (a Python node's backward is
    arbitrary code)."""

    scale: torch.Tensor
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * _ScaledByCaptured.scale


def _with_hook(scale: torch.Tensor, on_leaf: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if on_leaf:
            weight.register_hook(lambda grad: grad * scale)
            return _loss(weight, x)
        y = torch.tanh(x @ weight.T)
        y.register_hook(lambda grad: grad * scale)
        return y.pow(2).sum()

    return loss


@pytest.mark.parametrize("kind", ("python-node", "hook", "hook-on-the-input"))
def test_code_run_by_the_backward_keeps_it(create_graph_seen: list[bool], kind: str) -> None:
    """A Python node or a hook may use a tensor that requires grad and that the forward never touched: the
    per-sample gradients then depend on it, and differentiating them by it gives PyTorch's result."""
    weight, x = _inputs()
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    _ScaledByCaptured.scale = scale
    if kind == "python-node":
        def loss(w: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
            return _loss(_ScaledByCaptured.apply(w), sample)
    else:
        loss = _with_hook(scale, on_leaf=kind == "hook-on-the-input")

    def run(s: torch.Tensor) -> torch.Tensor:
        return _per_sample(loss)(weight, x)

    expected = _eager_second_derivative(run, scale)
    create_graph_seen.clear()
    with registry.use():
        got = _eager_second_derivative(run, scale)
    assert create_graph_seen == [True]
    torch.testing.assert_close(got, expected)


@pytest.fixture
def pytorchs_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """The ``create_graph`` of each call grad hands to functorch's own ``_autograd_grad`` (not one engine call)."""
    registry.install()
    calls: list[bool] = []
    pytorchs = first_order_grad.PYTORCH_AUTOGRAD_GRAD

    def spy(outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: bool = False,
            create_graph: bool = True) -> Any:
        calls.append(create_graph)
        return pytorchs(outputs, inputs, grad_outputs, retain_graph, create_graph)

    monkeypatch.setattr(first_order_grad, "PYTORCH_AUTOGRAD_GRAD", spy)
    yield calls


def test_one_engine_call_and_unused_inputs(pytorchs_calls: list[bool], routing_backend: str) -> None:
    """An input the loss does not use gets functorch's zeros from the engine call too."""
    weight, x = _inputs()
    unused = torch.ones(2, dtype=torch.float64)

    def loss(w: torch.Tensor, spare: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return _loss(w, sample)

    per_sample = func.vmap(func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))
    want = per_sample(weight, unused, x)
    pytorchs_calls.clear()
    with registry.use():
        got = per_sample(weight, unused, x)
    assert pytorchs_calls == ([] if routing_backend == "cpp" else [True])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], torch.zeros(SAMPLES, 2, dtype=torch.float64))


@pytest.mark.parametrize("case", ("debug logging", "compiled autograd", "integer output"))
def test_engine_call_leaves_pytorchs_where_it_matters(pytorchs_calls: list[bool], monkeypatch: pytest.MonkeyPatch,
                                                      request: pytest.FixtureRequest, routing_backend: str,
                                                      case: str) -> None:
    """Autograd's debug logging, a compiled-autograd compiler, an output ``_make_grads`` refuses: functorch's own
    ``_autograd_grad`` runs (without ``create_graph``, C++ backend) and gives what PyTorch gives."""
    weight, x = _inputs()
    loss: Callable[..., torch.Tensor] = _loss
    restored: list[Any] = []
    if case == "debug logging":
        log = first_order_grad.autograd_graph.log
        request.addfinalizer(functools.partial(log.setLevel, log.level))  # setLevel: the logger's cache too
        log.setLevel(logging.DEBUG)
    elif case == "compiled autograd":
        def compiler_set(compiler: Any, dynamic: bool) -> tuple[Any, bool]:  # reports one set, sets nothing
            restored.append(compiler)
            return ("a compiler", False) if compiler is None else (None, False)

        monkeypatch.setattr(first_order_grad, "_set_autograd_compiler", compiler_set)
    else:
        def loss(w: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
            return _loss(w, sample).to(torch.int64)

    def run() -> Any:
        try:
            return _per_sample(loss)(weight, x)
        except RuntimeError as error:
            return str(error)

    want = run()
    pytorchs_calls.clear()
    with registry.use():
        got = run()
    if isinstance(want, str):
        assert got == want
    else:
        torch.testing.assert_close(got, want)
    if case == "integer output":  # nothing requires grad: functorch's zeros, whatever the graph check says
        assert len(pytorchs_calls) == 1
    else:  # PyTorch's own ran, without create_graph where the backward is first-order (C++ backend)
        assert pytorchs_calls == [_first_order(routing_backend)]
    if case == "compiled autograd" and routing_backend == "cpp":
        assert restored == [None, "a compiler"]  # what was set is set again


def test_switched_off_keeps_it(create_graph_seen: list[bool]) -> None:
    weight, x = _inputs()
    first_order_grad.PATCH.enabled = False
    try:
        with registry.use():
            _per_sample()(weight, x)
    finally:
        first_order_grad.PATCH.enabled = True
    assert create_graph_seen == [True]


def test_uninstall_restores_functorchs() -> None:
    import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - what the patch replaces

    registry.uninstall()
    try:
        assert eager_transforms._autograd_grad is first_order_grad.PYTORCH_AUTOGRAD_GRAD
    finally:
        registry.install()


# --- the engine call with grad's level set aside (kernels/first_order.cpp's NOTE) ------------------------------------

def test_the_backward_runs_below_the_grad_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """C++ backend: the engine call returns the vmap level's tensors, not grad's wrappers (nothing of grad's level
    ran), grad's level is back on top of functorch's stack and alive afterwards, and the gradients equal PyTorch's."""
    from registry.core import routing

    registry.install()
    compiled = first_order_grad.PATCH.compiled
    if routing.routing_backend() != "cpp" or compiled is None:
        pytest.skip("the C++ backend's")
    weight, x = _inputs()
    want = _per_sample()(weight, x)
    seen: list[tuple[bool, bool, str]] = []
    below_grad = compiled.first_order_gradients

    def spy(outputs: list[torch.Tensor], ones: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
        grads = below_grad(outputs, ones, inputs)
        top = torch._C._functorch.peek_interpreter_stack()
        seen.extend((torch._C._functorch.is_gradtrackingtensor(g), torch._C._functorch.is_batchedtensor(g),
                     str(top.key())) for g in grads)
        outputs[0].sum()  # grad's wrapper is usable again (alive: an op on it goes through its level)
        return grads

    monkeypatch.setattr(compiled, "first_order_gradients", spy)
    with registry.use():
        got = _per_sample()(weight, x)
    torch.testing.assert_close(got, want)
    assert seen == [(False, True, "TransformType.Grad")]


def test_an_error_in_the_backward_puts_the_level_back() -> None:
    """A node that raises while grad's level is set aside (igamma's node: PyTorch has no derivative for its input):
    PyTorch's error, then functorch's stack is as before and the next call is right."""
    weight, x = _inputs()

    def loss(w: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return torch.igamma(w.abs() + 1, sample.abs() + 1).sum()

    def raised() -> str:
        with pytest.raises(RuntimeError) as caught:
            _per_sample(loss)(weight, x[:, :1].expand(SAMPLES, FEATURES))
        return str(caught.value)

    want = raised()
    with registry.use():
        got = raised()
        assert torch._C._functorch.maybe_current_level() is None
        torch.testing.assert_close(_per_sample()(weight, x), torch.stack([func.grad(_loss)(weight, s) for s in x]))
    assert "the derivative for 'igamma: input' is not implemented" in want and got == want


def test_grad_and_value_with_aux_below_the_grad_level() -> None:
    """has_aux's intermediate (a wrapper of grad's level, alive again after the backward), an unbatched gradient
    (one that does not depend on the samples) and the value: PyTorch's."""
    weight, x = _inputs()
    bias = torch.ones(OUT, dtype=torch.float64)

    def loss(w: torch.Tensor, b: torch.Tensor, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(sample @ w.T)
        return hidden.pow(2).sum() + b.sum(), hidden

    per_sample = func.vmap(func.grad_and_value(loss, argnums=(0, 1), has_aux=True), in_dims=(None, None, 0))
    want = per_sample(weight, bias, x)
    with registry.use():
        got = per_sample(weight, bias, x)
    for mine, theirs in zip(tree_leaves(got), tree_leaves(want), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_composites_in_the_backward_decompose_as_at_grads_level() -> None:
    """affine_grid's backward calls a composite op functorch has no batching rule for (NOTE [decompositions while
    grad's level is set aside]): with grad's level set aside it decomposes as at that level, without vmap's per-sample
    loop (profiled: no call of the op once per sample), and the gradients are PyTorch's; called under vmap outside such
    a backward, functorch's loop runs as before."""
    thetas = torch.randn(SAMPLES, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grid_gradients = torch.ones(SAMPLES, 1, 4, 4, 2, dtype=torch.float64)

    def loss(theta: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.affine_grid(theta[None], [1, 1, 4, 4], align_corners=False).pow(2).sum()

    def backward_calls(run: Callable[[], Any]) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run()
        return sum(event.count for event in profile.key_averages()
                   if event.key == "aten::affine_grid_generator_backward")

    def direct() -> torch.Tensor:
        return func.vmap(lambda g: torch.ops.aten.affine_grid_generator_backward(g, [1, 1, 4, 4], False))(
            grid_gradients)

    want = func.vmap(func.grad(loss))(thetas)
    with registry.use():
        got = func.vmap(func.grad(loss))(thetas)
        in_backward = backward_calls(lambda: func.vmap(func.grad(loss))(thetas))
        looped = backward_calls(direct)
        torch.testing.assert_close(direct(), torch.stack([torch.ops.aten.affine_grid_generator_backward(
            g, [1, 1, 4, 4], False) for g in grid_gradients]))
    torch.testing.assert_close(got, want)
    assert in_backward <= 1 and looped == SAMPLES + 1  # the call itself, then one per sample where functorch loops
