"""torch.func's vmap and grad with less Python per call (``registry/core/transform_calls.py``): inside ``use()``
they take the lean path for plain containers and flat ``in_dims``, and give what PyTorch's give (values, container
types, keys and their order, errors word for word); everything else, and everything outside ``use()``, runs
PyTorch's implementation."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import func
from torch.utils import _pytree as pytree  # noqa: PLC2701 - the structures compared as PyTorch's pytree sees them

import registry
from registry.core import transform_calls

pytestmark = pytest.mark.usefixtures("routing_backend")

SAMPLES = 5
Pair = namedtuple("Pair", "first second")


@pytest.fixture
def pytorch_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of PyTorch's implementations the patch handed a call to (vmap_impl, grad_and_value_impl)."""
    registry.install()
    calls: list[str] = []
    vmap_impl, grad_and_value_impl = transform_calls.PYTORCH_VMAP_IMPL, transform_calls.PYTORCH_GRAD_AND_VALUE_IMPL

    def vmap_spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("vmap")
        return vmap_impl(*args, **kwargs)

    def grad_spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("grad")
        return grad_and_value_impl(*args, **kwargs)

    monkeypatch.setattr(transform_calls, "PYTORCH_VMAP_IMPL", vmap_spy)
    monkeypatch.setattr(transform_calls, "PYTORCH_GRAD_AND_VALUE_IMPL", grad_spy)
    yield calls


def _params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(4, 3, dtype=torch.float64, generator=generator),
            "bias": torch.randn(4, dtype=torch.float64, generator=generator)}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(SAMPLES, 3, dtype=torch.float64, generator=generator),
            torch.randn(SAMPLES, 4, dtype=torch.float64, generator=generator))


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ p["weight"].T + p["bias"]) - y).pow(2).sum()


def _same(got: Any, want: Any) -> None:
    """Equal values in the same structure: container types, dict keys in the same order."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    assert [type(leaf) for leaf in got_leaves] == [type(leaf) for leaf in want_leaves]
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w)
        else:
            assert g == w


def _inside_and_out(call: Callable[[], Any]) -> tuple[Any, Any]:
    native = call()
    with registry.use():
        routed = call()
    return routed, native


def test_per_sample_gradients_take_the_lean_path(pytorch_calls: list[str]) -> None:
    params, (x, y) = _params(), _data()
    per_sample = func.vmap(func.grad(_loss), in_dims=(None, 0, 0))
    routed, native = _inside_and_out(lambda: per_sample(params, x, y))
    _same(routed, native)
    assert pytorch_calls == ["vmap", "grad"]  # the native call only
    leaves = [p.detach().requires_grad_() for p in params.values()]
    for b in range(SAMPLES):
        loop = torch.autograd.grad(_loss(dict(zip(params, leaves, strict=True)), x[b], y[b]), leaves)
        for name, g in zip(params, loop, strict=True):
            torch.testing.assert_close(routed[name][b], g)


@pytest.mark.parametrize("case", ["tuple-output", "list-output", "nested-dict", "none-inside", "non-tensor-leaf",
                                  "negative-in-dim", "int-in-dims", "in-dim-on-a-container", "dim-1"])
def test_structures_as_pytorch(pytorch_calls: list[str], case: str) -> None:
    x, y = _data()
    params = _params()
    if case == "tuple-output":
        fn = func.vmap(lambda a, b: (a.sin(), {"sum": a + b}), in_dims=(0, 0))
        args: tuple[Any, ...] = (x, x.cos())
    elif case == "list-output":
        fn = func.vmap(lambda a: [a * 2, [a.sum()]])
        args = (x,)
    elif case == "nested-dict":
        fn = func.vmap(lambda p, a: {"outer": {"w": p["inner"]["w"] @ a, "list": [a]}}, in_dims=(None, 0))
        args = ({"inner": {"w": params["weight"]}}, x)
    elif case == "none-inside":
        fn = func.vmap(lambda a, nothing, b: a * b.sum() if nothing is None else a, in_dims=(0, None, 0))
        args = (x, None, y)
    elif case == "non-tensor-leaf":
        fn = func.vmap(lambda a, scale, name: a * scale if name == "scaled" else a, in_dims=(0, None, None))
        args = (x, 3.0, "scaled")
    elif case == "negative-in-dim":
        fn = func.vmap(lambda a: a.sum(), in_dims=(-1,))
        args = (x.T.contiguous(),)
    elif case == "int-in-dims":
        fn = func.vmap(lambda a, b: a @ b[:3], in_dims=0)
        args = (x, y)
    elif case == "in-dim-on-a-container":
        fn = func.vmap(lambda pair: pair[0] + pair[1], in_dims=(0,))
        args = ((x, x * 2),)
    else:
        fn = func.vmap(lambda a: a.pow(2), in_dims=1, out_dims=1)
        args = (x,)
    routed, native = _inside_and_out(lambda: fn(*args))
    _same(routed, native)
    assert pytorch_calls == ["vmap"]


@pytest.mark.parametrize("case", ["ordered-dict", "namedtuple", "nested-in-dims", "chunk-size", "out-dims-tuple",
                                  "int-dict-keys"])
def test_other_forms_run_pytorchs(pytorch_calls: list[str], case: str) -> None:
    x, _ = _data()
    if case == "ordered-dict":
        fn = func.vmap(lambda d: d["a"] * 2)
        args: tuple[Any, ...] = (OrderedDict(a=x),)
    elif case == "namedtuple":
        fn = func.vmap(lambda pair: pair.first - pair.second)
        args = (Pair(x, x.exp()),)
    elif case == "nested-in-dims":
        fn = func.vmap(lambda d: d["a"] + d["b"], in_dims=({"a": 0, "b": None},))
        args = ({"a": x, "b": x[0]},)
    elif case == "chunk-size":
        fn = func.vmap(lambda a: a.sin(), chunk_size=2)
        args = (x,)
    elif case == "out-dims-tuple":
        fn = func.vmap(lambda a: (a, a.sum()), out_dims=(0, 0))
        args = (x,)
    else:
        fn = func.vmap(lambda d: d[1] * 2)
        args = ({1: x},)
    routed, native = _inside_and_out(lambda: fn(*args))
    _same(routed, native)
    assert pytorch_calls == ["vmap", "vmap"]


def _error(call: Callable[[], Any]) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as caught:  # compared with PyTorch's, type and text
        call()
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize("case", ["in-dim-out-of-range", "sizes-differ", "nothing-batched", "non-tensor-batched",
                                  "in-dims-length", "no-inputs", "output-not-a-tensor", "none-output",
                                  "out-dim-none-batched", "none-batched"])
def test_vmap_errors_as_pytorch(case: str) -> None:
    x, y = _data()
    calls: dict[str, Callable[[], Any]] = {
        "in-dim-out-of-range": lambda: func.vmap(torch.sin, in_dims=(2,))(x),
        "sizes-differ": lambda: func.vmap(torch.add)(x, y[:3]),
        "nothing-batched": lambda: func.vmap(torch.sin, in_dims=(None,))(x),
        "non-tensor-batched": lambda: func.vmap(lambda a, s: a * s, in_dims=(0, 0))(x, 2.0),
        "in-dims-length": lambda: func.vmap(torch.add, in_dims=(0,))(x, x),
        "no-inputs": lambda: func.vmap(lambda: torch.zeros(1))(),
        "output-not-a-tensor": lambda: func.vmap(lambda a: (a, 3))(x),
        "none-output": lambda: func.vmap(lambda a: {"a": a, "nothing": None})(x),
        "none-batched": lambda: func.vmap(lambda a, nothing: a, in_dims=(0, 0))(x, None),
        "out-dim-none-batched": lambda: func.vmap(lambda a: a * 2, out_dims=None)(x),
    }
    registry.install()
    native = _error(calls[case])
    with registry.use():
        routed = _error(calls[case])
    assert routed == native


@pytest.mark.parametrize("case", ["argnums", "negative-argnums", "has-aux", "grad-and-value", "under-no-grad",
                                  "int-args"])
def test_grad_as_pytorch(pytorch_calls: list[str], case: str) -> None:
    params, (x, y) = _params(), _data()
    if case == "argnums":
        fn = func.grad(_loss, argnums=(0, 1))
    elif case == "negative-argnums":
        fn = func.grad(_loss, argnums=-2)
    elif case == "has-aux":
        fn = func.grad(lambda p, a, b: (_loss(p, a, b), {"scaled": a * 2, "pair": (b, b.sum())}), has_aux=True)
    elif case == "grad-and-value":
        fn = func.grad_and_value(_loss)
    elif case == "under-no-grad":
        def fn(p: dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> Any:
            with torch.no_grad():
                return func.grad(_loss)(p, a, b)
    else:
        fn = func.grad(lambda p, a, b, power: _loss(p, a, b) ** power)
        routed, native = _inside_and_out(lambda: fn(params, x[0], y[0], 2))
        _same(routed, native)
        assert pytorch_calls == ["grad"]
        return
    routed, native = _inside_and_out(lambda: fn(params, x[0], y[0]))
    _same(routed, native)
    assert pytorch_calls == ["grad"]


@pytest.mark.parametrize("case", ["not-scalar", "not-a-tensor", "aux-not-a-pair", "argnums-out-of-range",
                                  "argnums-repeated", "non-tensor-differentiated", "integer-differentiated",
                                  "saved-tensors-hooks"])
def test_grad_errors_as_pytorch(case: str) -> None:
    params, (x, y) = _params(), _data()

    def hooked(p: dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return _loss(p, a, b)

    calls: dict[str, Callable[[], Any]] = {
        "not-scalar": lambda: func.grad(lambda p, a: p["weight"] @ a)(params, x[0]),
        "not-a-tensor": lambda: func.grad(lambda p, a: 1.0)(params, x[0]),
        "aux-not-a-pair": lambda: func.grad(lambda p, a, b: _loss(p, a, b), has_aux=True)(params, x[0], y[0]),
        "argnums-out-of-range": lambda: func.grad(_loss, argnums=3)(params, x[0], y[0]),
        "argnums-repeated": lambda: func.grad(_loss, argnums=(0, 0))(params, x[0], y[0]),
        "non-tensor-differentiated": lambda: func.grad(lambda s, a: a.sum() * s)(2.0, x[0]),
        "integer-differentiated": lambda: func.grad(lambda i, a: a.sum())(torch.arange(3), x[0]),
        "saved-tensors-hooks": lambda: func.grad(hooked)(params, x[0], y[0]),
    }
    registry.install()
    native = _error(calls[case])
    with registry.use():
        routed = _error(calls[case])
    assert routed == native


@pytest.mark.parametrize("stack", ["vmap(vmap(grad))", "grad(grad)", "jacrev(grad)", "hessian", "vmap(jacrev)",
                                   "grad(vmap)"])
def test_nested_transforms_as_pytorch(stack: str) -> None:
    params, (x, _) = _params(), _data()
    weight = params["weight"]

    def scalar(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ w.T).pow(3).sum()

    calls: dict[str, Callable[[], Any]] = {
        "vmap(vmap(grad))": lambda: func.vmap(func.vmap(func.grad(scalar), in_dims=(None, 0)), in_dims=(None, 0))(
            weight, x.reshape(SAMPLES, 1, 3).expand(SAMPLES, 2, 3)),
        "grad(grad)": lambda: func.grad(lambda a: func.grad(scalar, argnums=1)(weight, a).sum())(x[0]),
        "jacrev(grad)": lambda: func.jacrev(func.grad(scalar))(weight, x[0]),
        "hessian": lambda: func.hessian(scalar, argnums=1)(weight, x[0]),
        "vmap(jacrev)": lambda: func.vmap(func.jacrev(lambda a: torch.tanh(weight @ a)))(x),
        "grad(vmap)": lambda: func.grad(lambda w: func.vmap(scalar, in_dims=(None, 0))(w, x).sum())(weight),
    }
    registry.install()
    routed, native = _inside_and_out(calls[stack])
    _same(routed, native)


def test_outside_use_and_switched_off_run_pytorchs(pytorch_calls: list[str]) -> None:
    params, (x, y) = _params(), _data()
    per_sample = func.vmap(func.grad(_loss), in_dims=(None, 0, 0))
    per_sample(params, x, y)
    assert pytorch_calls == ["vmap", "grad"]
    transform_calls.PATCH.enabled = False
    try:
        with registry.use():
            per_sample(params, x, y)
    finally:
        transform_calls.PATCH.enabled = True
    assert pytorch_calls == ["vmap", "grad"] * 2
    with registry.use(policy="native"):
        per_sample(params, x, y)
    assert pytorch_calls == ["vmap", "grad"] * 3


def test_functionalization_still_retries_the_level(pytorch_calls: list[str]) -> None:
    x, _ = _data()

    def writes(a: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(3, dtype=a.dtype)
        out.copy_(a)  # a batched value into a fresh buffer: vmap refuses, use() functionalizes the level
        return out * 2

    with registry.use():
        got = func.vmap(writes)(x)
    torch.testing.assert_close(got, x * 2)
    assert pytorch_calls == []


def test_uninstall_restores_functorchs() -> None:
    import torch._functorch.apis as apis  # noqa: PLC2701 - what the patch replaces
    import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - what the patch replaces

    registry.install()
    assert apis.vmap_impl == transform_calls.PATCH.vmap_impl
    registry.uninstall()
    try:
        assert apis.vmap_impl is transform_calls.PYTORCH_VMAP_IMPL
        assert eager_transforms.grad_and_value_impl is transform_calls.PYTORCH_GRAD_AND_VALUE_IMPL
    finally:
        registry.install()
