from __future__ import annotations

import threading

import pytest
import torch
from torch import func

import registry
from registry.core.registration import register, unregister
from registry.core.selector import SelectionError

ORIGINAL_METHOD = torch.Tensor.index_fill
ORIGINAL_FUNCTION = torch.index_fill


@pytest.fixture
def spy():
    """A functional index_fill that records its calls: pin it to see what use() routes."""
    calls: list[tuple] = []

    @register("index_fill", "functional", name="test-spy")
    def index_fill_spy(self, dim, index, value):
        """Records the call, then computes like the functional composite."""
        calls.append((dim, value))
        return registry.composites("index_fill")["functional"].fn(self, dim, index, value)

    yield calls
    unregister("index_fill", "test-spy")


def test_pytorch_untouched_outside_use() -> None:
    assert torch.Tensor.index_fill is ORIGINAL_METHOD
    with registry.use():
        assert torch.Tensor.index_fill is not ORIGINAL_METHOD
        assert torch.add is torch.add and torch.Tensor.add is torch._C.TensorBase.add  # uncovered: untouched
    assert torch.Tensor.index_fill is ORIGINAL_METHOD
    assert torch.index_fill is ORIGINAL_FUNCTION


def test_every_entry_point_is_routed(spy) -> None:
    x, index = torch.randn(4, 3), torch.tensor([1, 3])
    expected = ORIGINAL_METHOD(x, 0, index, 2.0)
    with registry.use(pins={"index_fill": "test-spy"}):
        torch.testing.assert_close(x.index_fill(0, index, 2.0), expected)
        torch.testing.assert_close(torch.index_fill(x, 0, index, 2.0), expected)
        torch.testing.assert_close(torch.index_fill(input=x, dim=0, index=index, value=2.0), expected)
    assert len(spy) == 3


def test_out_and_unknown_keywords_go_to_pytorch(spy) -> None:
    x, index = torch.randn(4, 3), torch.tensor([1])
    out = torch.empty(4, 3)
    with registry.use(pins={"index_fill": "test-spy", "index_add": "functional"}):
        torch.index_add(x, 1, index, torch.ones(4, 1), out=out)
        with pytest.raises(TypeError, match="index_fill"):  # PyTorch's own message for a bad keyword
            x.index_fill(1, index, valu=0.0)
    torch.testing.assert_close(out, torch.index_add(x, 1, index, torch.ones(4, 1)))
    assert spy == []


def test_nesting_inner_wins_and_restores(spy) -> None:
    x, index = torch.randn(4, 3), torch.tensor([0])
    with registry.use(pins={"index_fill": "test-spy"}):
        with registry.use(policy="native"):
            x.index_fill(0, index, 1.0)
        assert spy == []
        x.index_fill(0, index, 1.0)
        assert len(spy) == 1


def test_decorator_form(spy) -> None:
    @registry.use(pins={"index_fill": "test-spy"})
    def f(x):
        return x.index_fill(0, torch.tensor([0]), 1.0)

    f(torch.randn(2, 2))
    f(torch.randn(2, 2))
    assert len(spy) == 2
    assert not registry.routing_active()


def test_thread_local(spy) -> None:
    inside, outside_done = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        torch.randn(3, 3).index_fill(0, torch.tensor([1]), 5.0)  # not inside use() in this thread
        outside_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with registry.use(pins={"index_fill": "test-spy"}):
        inside.set()
        outside_done.wait(10)
    thread.join()
    assert spy == []


def test_invalid_pin_raises_where_the_op_runs() -> None:
    with registry.use(pins={"index_fill": "mutating"}), pytest.raises(SelectionError, match="valid choices"):
        func.vmap(lambda v: torch.zeros(3).index_fill(0, torch.tensor([1]), v))(torch.randn(4))


def test_use_validates_its_arguments() -> None:
    with pytest.raises(SelectionError, match="unknown policy 'fast'"):
        registry.use(policy="fast")
    with pytest.raises(SelectionError, match="unknown op 'index_fil'"):
        registry.use(pins={"index_fil": "functional"})
    with pytest.raises(SelectionError, match="index_fill has no composite or kind 'fused'"):
        registry.use(pins={"index_fill": "fused"})



def test_headline_vmap_grad_index_fill_with_batched_value() -> None:
    """vmap(grad(f)) where f fills an unbatched tensor with a value computed from the batched input."""
    base, index = torch.randn(5, 4), torch.tensor([0, 2])

    def f(x):
        return (base.index_fill(0, index, x.sum()) * x).pow(2).sum()

    x = torch.randn(8, 5, 4, dtype=torch.float32)
    with registry.use():
        batched = func.vmap(func.grad(f))(x)
    expected = []
    for row in x:
        leaf = row.clone().requires_grad_()
        expected.append(torch.autograd.grad(f(leaf), leaf)[0])
    torch.testing.assert_close(batched, torch.stack(expected))


def test_chunk_size_and_eager_autograd_through_vmap() -> None:
    mask = torch.rand(6, 4) > 0.5
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    source = torch.randn(6, 4, dtype=torch.float64)
    with registry.use():
        y = func.vmap(lambda s, m, src: s.masked_scatter(m, src), chunk_size=2)(x, mask, source)
        (y * y).sum().backward()
    expected = torch.stack([x[i].detach().masked_scatter(mask[i], source[i]) for i in range(6)])
    torch.testing.assert_close(y.detach(), expected)
    loop_grad = torch.zeros_like(x)
    for i in range(6):
        leaf = x[i].detach().clone().requires_grad_()
        out = leaf.masked_scatter(mask[i], source[i])
        loop_grad[i] = torch.autograd.grad((out * out).sum(), leaf)[0]
    torch.testing.assert_close(x.grad, loop_grad)


def test_to_overloads_route(spy) -> None:
    x = torch.randn(2, 3, 4, 5)
    with registry.use(pins={"to": "functional"}):
        assert x.to(torch.float64).dtype == torch.float64
        assert x.to("cpu", torch.float64).dtype == torch.float64
        assert x.to(torch.zeros(1, dtype=torch.int32)).dtype == torch.int32
        assert x.to(memory_format=torch.channels_last).is_contiguous(memory_format=torch.channels_last)
        assert x.to(torch.float32) is x
        assert x.to(torch.float32, copy=True) is not x
        assert x.to(torch.float32, False, True) is not x


def test_vjp_and_jvp_route() -> None:
    mask = torch.rand(5) > 0.5
    x, source = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    cotangent = torch.randn(5, dtype=torch.float64)
    with registry.use():
        out, vjp_fn = func.vjp(lambda s, src: s.masked_scatter(mask, src), x, source)
        grads = vjp_fn(cotangent)
        ones = torch.ones(5, dtype=x.dtype)
        _, tangent_out = func.jvp(lambda s: s.index_fill(0, torch.tensor([1]), 3.0), (x,), (ones,))
    leaf_x, leaf_s = x.clone().requires_grad_(), source.clone().requires_grad_()
    expected = torch.autograd.grad(leaf_x.masked_scatter(mask, leaf_s), (leaf_x, leaf_s), cotangent)
    torch.testing.assert_close(out, x.masked_scatter(mask, source))
    torch.testing.assert_close(grads, expected)
    torch.testing.assert_close(tangent_out, torch.ones(5, dtype=x.dtype).index_fill(0, torch.tensor([1]), 0.0))
