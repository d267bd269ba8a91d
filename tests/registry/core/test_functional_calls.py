"""torch.func.functional_call with one walk of the module tree (``registry/core/functional_calls.py``): inside
``use()`` it calls the module with the given tensors and leaves the module and the caller's dict as PyTorch's does;
tied tensors, ``strict``, names that are not parameters or buffers, values that are not tensors and modules that list
their members their own way run PyTorch's, with its errors; outside ``use()`` PyTorch's runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import func, nn
from torch.nn.utils import stateless

import registry
from registry.core import functional_calls

pytestmark = pytest.mark.usefixtures("routing_backend")


@pytest.fixture
def pytorch_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """One entry per call the patch handed to PyTorch's ``_functional_call``."""
    registry.install()
    calls: list[str] = []
    pytorch = functional_calls.PYTORCH_FUNCTIONAL_CALL

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("pytorch")
        return pytorch(*args, **kwargs)

    monkeypatch.setattr(functional_calls, "PYTORCH_FUNCTIONAL_CALL", spy)
    yield calls


class Counting(nn.Module):
    """A linear layer and a buffer the forward replaces (a step counter): what ends up in the caller's dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).double()
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.steps = self.steps + 1
        return self.linear(x) * scale + self.steps


class Tied(nn.Module):
    """One linear layer under two names (``first`` and ``second``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3).double()
        self.second = self.first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class OwnListing(nn.Sequential):
    """A module that lists its parameters its own way."""

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return super().named_parameters(*args, **kwargs)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.BatchNorm1d(2).eval()).double()


def _replacements(module: nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    replaced = {name: torch.randn(t.shape, dtype=t.dtype, generator=generator)
                for name, t in module.named_parameters()}
    replaced.update({name: torch.rand(t.shape, dtype=t.dtype, generator=generator) + 0.5
                     for name, t in module.named_buffers() if t.is_floating_point()})
    return replaced


def _x() -> torch.Tensor:
    return torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def _both(call: Callable[[], Any]) -> tuple[Any, Any]:
    """``call`` outside ``use()`` (PyTorch's) and inside."""
    native = call()
    with registry.use():
        return call(), native


def test_takes_the_lean_path_and_equals_pytorch(pytorch_calls: list[str]) -> None:
    model, x = _model(), _x()
    replaced = _replacements(model)
    before = _state(model)
    with registry.use():
        got = func.functional_call(model, replaced, (x,))
    assert pytorch_calls == []
    want = func.functional_call(model, replaced, (x,))
    torch.testing.assert_close(got, want)
    after = _state(model)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)  # the module's own again


def test_some_names_and_the_deprecated_entry_point(pytorch_calls: list[str]) -> None:
    model, x = _model(), _x()
    some = {"0.weight": _replacements(model)["0.weight"]}
    got, want = _both(lambda: func.functional_call(model, some, x))
    torch.testing.assert_close(got, want)
    with pytest.warns(FutureWarning), registry.use():
        deprecated = stateless.functional_call(model, some, (x,))
    torch.testing.assert_close(deprecated, want)
    assert pytorch_calls == ["pytorch"]  # the native call


def test_a_forward_that_replaces_a_buffer_writes_it_back(pytorch_calls: list[str]) -> None:
    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        torch.manual_seed(0)
        model = Counting()
        given = {"steps": torch.tensor(5.0, dtype=torch.float64),
                 **{name: p.detach() for name, p in model.linear.named_parameters(prefix="linear")}}
        out = func.functional_call(model, given, (_x(),), {"scale": 2.0})
        return out, given["steps"], model.steps, float(given["linear.weight"].sum())

    got, want = _both(run)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert float(got[1]) == 6.0 and float(got[2]) == 0.0  # the caller's dict holds the new count, the module its own
    assert pytorch_calls == ["pytorch"]


def test_an_error_in_the_forward_restores_the_module(pytorch_calls: list[str]) -> None:
    model = _model()
    before = _state(model)
    with registry.use(), pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied"):
        func.functional_call(model, _replacements(model), (torch.randn(5, 7, dtype=torch.float64),))
    after = _state(model)
    assert all(after[k] is before[k] for k in before)
    assert pytorch_calls == []


@pytest.mark.parametrize("case", ["tied", "strict", "attribute", "not a tensor", "own listing", "scripted"])
def test_other_calls_run_pytorchs(pytorch_calls: list[str], case: str) -> None:
    x = _x()
    if case == "tied":
        model: Any = Tied()
        given: dict[str, Any] = {"first.weight": torch.eye(3, dtype=torch.float64)}
    elif case == "strict":
        model = _model()
        given = _replacements(model)
    elif case == "attribute":
        model = _model()
        given = {"extra": torch.ones(1)}  # not a parameter or buffer: PyTorch sets it as an attribute
    elif case == "not a tensor":
        model = _model()
        given = {"0.weight": None}  # PyTorch's swap takes None for a parameter
    elif case == "own listing":
        model = OwnListing(nn.Linear(3, 2)).double()
        given = {"0.bias": torch.zeros(2, dtype=torch.float64)}
    else:
        model = torch.jit.script(nn.Linear(3, 2).double())
        given = {"bias": torch.zeros(2, dtype=torch.float64)}

    def call() -> Any:
        try:
            return func.functional_call(model, given, (x,), strict=case == "strict")
        except (RuntimeError, TypeError, ValueError) as error:  # PyTorch's refusal: what is compared
            return type(error), str(error)

    got, want = _both(call)
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want)
    else:
        assert got == want
    assert pytorch_calls == ["pytorch", "pytorch"]


def test_tied_errors_as_pytorch() -> None:
    model = Tied()
    given = {"first.weight": torch.eye(3, dtype=torch.float64), "second.weight": torch.zeros(3, 3, dtype=torch.float64)}
    with pytest.raises(ValueError) as native:
        func.functional_call(model, given, (_x(),))
    with registry.use(), pytest.raises(ValueError) as routed:
        func.functional_call(model, given, (_x(),))
    assert str(routed.value) == str(native.value)


def test_untied_call_of_a_tied_module_takes_the_lean_path(pytorch_calls: list[str]) -> None:
    model = Tied()
    given = {"first.weight": torch.eye(3, dtype=torch.float64)}  # second.weight stays the module's
    got, want = _both(lambda: func.functional_call(model, given, (_x(),), tie_weights=False))
    torch.testing.assert_close(got, want)
    assert pytorch_calls == ["pytorch"]


def test_per_sample_gradients_equal_the_loop(pytorch_calls: list[str]) -> None:
    model, x = _model(), _x()
    params = {name: p.detach() for name, p in model.named_parameters()}
    target = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss(p: dict[str, torch.Tensor], sample: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (func.functional_call(model, p, (sample.unsqueeze(0),)) - y).pow(2).sum()

    with registry.use():
        got = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, target)
    assert pytorch_calls == []
    for b in range(5):
        want = torch.autograd.grad((model(x[b:b + 1]) - target[b]).pow(2).sum(), list(model.parameters()))
        for name, w in zip(params, want, strict=True):
            torch.testing.assert_close(got[name][b], w)


def test_outside_use_switched_off_and_native_policy_run_pytorchs(pytorch_calls: list[str]) -> None:
    model, x = _model(), _x()
    replaced = _replacements(model)
    func.functional_call(model, replaced, (x,))
    functional_calls.PATCH.enabled = False
    try:
        with registry.use():
            func.functional_call(model, replaced, (x,))
    finally:
        functional_calls.PATCH.enabled = True
    with registry.use(policy="native"):
        func.functional_call(model, replaced, (x,))
    assert pytorch_calls == ["pytorch"] * 3


def test_uninstall_restores_pytorchs() -> None:
    registry.install()
    assert stateless._functional_call == functional_calls.PATCH.functional_call
    registry.uninstall()
    try:
        assert stateless._functional_call is functional_calls.PYTORCH_FUNCTIONAL_CALL
    finally:
        registry.install()
