from __future__ import annotations

import pytest
import torch
from torch import func

import registry
from registry.core.context import context_of
from registry.core.stacks import parse_stack


def _seen(fn, *args):
    found = []

    def probe(*tensors):
        found.append(registry.current_stack(*tensors))
        return fn(*tensors)

    return probe, found


@pytest.mark.parametrize(
    ("transform", "expected"),
    [
        (lambda f: f, ()),
        (lambda f: func.vmap(f), ("vmap",)),
        (lambda f: func.grad(lambda x: f(x).sum()), ("grad",)),
        (lambda f: func.vmap(func.grad(lambda x: f(x).sum())), ("vmap", "grad")),
        (lambda f: func.grad(lambda x: func.vmap(f)(x).sum()), ("grad", "vmap")),
        (lambda f: func.jacfwd(f), ("vmap", "jvp")),
        (lambda f: func.jacrev(f), ("grad",)),  # the vmap runs later, over the backward
        (lambda f: func.functionalize(f), ("functionalize",)),
        (lambda f: func.vmap(func.vmap(f)), ("vmap", "vmap")),
    ],
)
def test_current_stack_outermost_first(transform, expected) -> None:
    probe, found = _seen(lambda x: x * 2)
    transform(probe)(torch.randn(2, 3))
    assert found[0] == expected


def test_autograd_when_recording() -> None:
    x = torch.randn(3, requires_grad=True)
    assert registry.current_stack(x) == ("autograd",)
    with torch.no_grad():
        assert registry.current_stack(x) == ()
    assert registry.current_stack(torch.randn(3)) == ()


def test_compile_while_dynamo_traces() -> None:
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        seen.append(registry.current_stack(x))
        return x + 1

    f(torch.randn(3))
    assert seen == [("compile",)]


def test_context_knows_batched_arguments_by_name() -> None:
    contexts = []
    self_ = torch.randn(4, 5)

    def f(value):
        contexts.append(context_of({"self": self_, "value": value}))
        return value

    func.vmap(f)(torch.randn(3))
    ctx = contexts[0]
    assert ctx.stack == ("vmap",)
    assert ctx.batched == ("value",)
    assert ctx.self_covers_batching is False
    assert (ctx.dtype, ctx.device, ctx.numel) == (torch.float32, "cpu", 20)


def test_batched_under_grad_wrappers() -> None:
    contexts = []

    def f(x):
        contexts.append(context_of({"self": x}))
        return x.sum()

    func.vmap(func.grad(f))(torch.randn(3, 4))
    assert contexts[0].batched == ("self",)


def test_parse_stack_aliases_and_errors() -> None:
    assert parse_stack("vmap, grad") == ("vmap", "grad")
    assert parse_stack(["jacfwd"]) == ("vmap", "jvp")
    assert parse_stack("") == ()
    with pytest.raises(ValueError, match="unknown transform 'vamp'.*valid: vmap, grad, jvp"):
        parse_stack("vamp,grad")
