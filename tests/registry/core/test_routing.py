"""use() routes at PyTorch's dispatcher: every caller, under every transform, and nothing else."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import func

import registry
from registry.core import routing
from registry.core.registration import register, unregister
from registry.core.selector import SelectionError
from registry.harness.checks import check
from registry.harness.samples import SAMPLES
from tests.registry.core.captured import CAPTURED, fill_rows

pytestmark = pytest.mark.usefixtures("routing_backend")

ORIGINAL_METHOD = torch._C.TensorBase.index_fill
ORIGINAL_FUNCTION = torch.index_fill
FALLBACK = "There is a performance drop"


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


@pytest.fixture
def add_spy():
    calls: list[int] = []

    @register("index_add", "functional", name="test-add-spy")
    def index_add_spy(self, dim, index, source, *, alpha=1):
        """Records the call, then computes like the functional composite."""
        calls.append(dim)
        return registry.composites("index_add")["functional"].fn(self, dim, index, source, alpha=alpha)

    yield calls
    unregister("index_add", "test-add-spy")


def _loop(fn, *batched):
    return torch.stack([fn(*row) for row in zip(*batched, strict=True)])


def test_nothing_is_patched_but_contiguous() -> None:
    with registry.use():
        assert torch.Tensor.index_fill is ORIGINAL_METHOD
        assert torch.index_fill is ORIGINAL_FUNCTION
        assert torch.Tensor.add is torch._C.TensorBase.add
    assert torch.Tensor.contiguous is routing._contiguous  # the one Python-level path, listed in docs/routing.md


def test_eager_calls_run_pytorchs_own_kernel(spy) -> None:
    """Outside any transform the routing kernels are never reached: even a pinned op runs PyTorch's kernel."""
    x, index = torch.randn(4, 3), torch.tensor([1, 3])
    with registry.use(pins={"index_fill": "test-spy"}):
        torch.testing.assert_close(x.index_fill(0, index, 2.0), ORIGINAL_METHOD(x, 0, index, 2.0))
    assert spy == []


def test_every_entry_point_is_routed_under_vmap(spy) -> None:
    x, index = torch.randn(5, 4, 3), torch.tensor([1, 3])
    expected = _loop(lambda row: ORIGINAL_METHOD(row, 0, index, 2.0), x)
    calls = [
        lambda r: r.index_fill(0, index, 2.0),
        lambda r: torch.index_fill(r, 0, index, 2.0),
        lambda r: torch.index_fill(input=r, dim=0, index=index, value=2.0),
        lambda r: CAPTURED["index_fill"](r, 0, index, 2.0),
        lambda r: fill_rows(r, index=index, value=2.0),
        lambda r: torch.ops.aten.index_fill.int_Scalar(r, 0, index, 2.0),
    ]
    with registry.use(pins={"index_fill": "test-spy"}):
        for call in calls:
            torch.testing.assert_close(func.vmap(call)(x), expected)
    assert len(spy) == len(calls)


@pytest.mark.parametrize("stack", ["vmap", "vmap(grad)", "jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize(
    ("op", "sample_name"),
    [("masked_scatter", "same-shape"), ("index_fill", "tensor-negdim"), ("masked_fill", "tensor-broadcast-mask")],
)
def test_captured_references_are_routed(op: str, sample_name: str, stack: str) -> None:
    """Function objects captured at import run inside use() with no fallback and the values of the native loop."""
    sample = next(s for s in SAMPLES[op] if s.name == sample_name and s.dtype == torch.float64)
    captured = CAPTURED[op]

    def call(args):
        return captured(*args.values())

    native = check(sample, stack, "all", call)
    with registry.use():
        routed = check(sample, stack, "all", call)
    assert routed.status == "ok", routed.detail
    if op == "masked_scatter":  # PyTorch alone loops there, forward or backward: routing is what fixes it
        assert native.status == "slow", native


def test_cpp_caller_index_select_backward_reaches_index_add(add_spy) -> None:
    """jacrev(index_select): index_select_backward (C++) calls index_add under vmap."""
    x, index = torch.randn(5, dtype=torch.float64), torch.tensor([1, 1, 3])
    with registry.use(pins={"index_add": "test-add-spy"}):
        jacobian = func.jacrev(lambda a: a.index_select(0, index))(x)
    assert add_spy == [0]
    torch.testing.assert_close(jacobian, torch.eye(5, dtype=torch.float64)[index])


def test_cpp_caller_norm_backward_reaches_masked_fill_() -> None:
    """hessian(norm): norm_backward (C++) calls masked_fill_ in place; it is routed and the values hold."""
    x = torch.randn(5, dtype=torch.float64)
    with registry.use(record=True) as run:
        hessian = func.hessian(torch.linalg.vector_norm)(x)
    assert run.calls.get("masked_fill_.Scalar", 0) >= 1
    norm = x.norm()
    expected = (torch.eye(5, dtype=torch.float64) - torch.outer(x, x) / norm**2) / norm
    torch.testing.assert_close(hessian, expected)


@pytest.mark.parametrize(
    ("name", "inplace"),
    [
        ("masked_scatter_", lambda s, m, v, i: s.masked_scatter_(m, v)),
        ("masked_fill_.Tensor", lambda s, m, v, i: s.masked_fill_(m, v.sum())),
        ("index_fill_.int_Tensor", lambda s, m, v, i: s.index_fill_(0, i, v.sum())),
        ("index_add_", lambda s, m, v, i: s.index_add_(0, i, v[: len(i)])),
        ("index_copy_", lambda s, m, v, i: s.index_copy_(0, i, v[: len(i)])),
    ],
)
def test_inplace_variants_under_vmap_with_batched_self(name, inplace, fallback_warnings) -> None:
    x, source = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    mask, index = torch.rand(4, 6) > 0.5, torch.tensor([4, 1])

    def f(s, m, v):
        out = s.clone()
        result = inplace(out, m, v, index)
        assert result is out  # in-place: self itself comes back
        return out

    with registry.use():
        batched = func.vmap(f)(x, mask, source)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []
    torch.testing.assert_close(batched, _loop(f, x, mask, source))


def _kernels_called(f: Callable[[], object]) -> list[str]:
    with torch.profiler.profile() as profiled:
        f()
    return sorted(event.name for event in profiled.events() if event.name.startswith("aten::"))


@pytest.mark.parametrize(
    ("op", "name", "inplace"),
    [
        ("masked_fill", "masked_fill_.Scalar", lambda s, m, i: s.masked_fill_(m, 0.5)),
        ("index_add", "index_add_", lambda s, m, i: s.index_add_(0, i, m[: len(i)].double())),
    ],
)
def test_native_inplace_variants_with_a_batching_rule_run_as_pytorch_does(op, name, inplace) -> None:
    """Where the decision is PyTorch's own op and functorch batches the in-place overload, its in-place kernel runs
    as without use(): the same aten kernels are called (no out-of-place result copied back into self)."""
    x, mask, index = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, 6) > 0.5, torch.tensor([4, 1])
    run = func.vmap(lambda s, m: inplace(s.clone(), m, index))
    expected = run(x, mask)
    native_kernels = _kernels_called(lambda: run(x, mask))
    with registry.use(record=True) as block:
        routed_kernels = _kernels_called(lambda: run(x, mask))
        torch.testing.assert_close(run(x, mask), expected)
    assert block.calls.get(name, 0) >= 1
    assert {d.composite for d in block.decisions if d.op == op} == {"native"}
    assert routed_kernels == native_kernels


def test_inplace_into_unbatched_fresh_buffer_runs_functionalized() -> None:
    """Writing a batched value into an unbatched fresh buffer in place: PyTorch refuses; inside use() the level runs
    functionalized (registry.core.functionalization) and equals the per-sample loop."""
    base, index = torch.zeros(5), torch.tensor([1])
    values = torch.randn(3)
    with pytest.raises(RuntimeError) as native:
        func.vmap(lambda v: base.clone().index_fill_(0, index, v))(values)
    assert str(native.value).startswith("vmap: index_fill_(self, *extra_args) is not possible")
    with registry.use():
        routed = func.vmap(lambda v: base.clone().index_fill_(0, index, v))(values)
    torch.testing.assert_close(routed, torch.stack([base.clone().index_fill_(0, index, v) for v in values]))


def test_vmap_grad_masked_scatter_has_no_backward_fallback(fallback_warnings) -> None:
    mask = torch.rand(8, 5) > 0.5
    x, source = torch.randn(8, 5), torch.randn(8, 5)

    def loss(s, m, v):
        return s.masked_scatter(m, v).pow(2).sum()

    func.vmap(func.grad(loss, argnums=(0, 2)))(x, mask, source)  # outside use(): PyTorch's loops
    native = [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)]
    assert any("masked_scatter" in message for message in native)
    fallback_warnings.clear()
    with registry.use():
        grads = func.vmap(func.grad(loss, argnums=(0, 2)))(x, mask, source)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []
    expected = _loop(lambda s, m, v: torch.stack(func.grad(loss, argnums=(0, 2))(s, m, v)), x, mask, source)
    torch.testing.assert_close(torch.stack(grads, 1), expected)


def test_out_and_named_overloads_go_to_pytorch(spy) -> None:
    x, index = torch.randn(4, 3), torch.tensor([1])
    out = torch.empty(4, 3)
    with registry.use(pins={"index_fill": "test-spy", "index_add": "functional"}):
        torch.index_add(x, 1, index, torch.ones(4, 1), out=out)
        with pytest.raises(TypeError, match="index_fill"):  # PyTorch's own message for a bad keyword
            func.vmap(lambda r: r.index_fill(0, index, valu=0.0))(x)
    torch.testing.assert_close(out, torch.index_add(x, 1, index, torch.ones(4, 1)))
    assert spy == []


def test_nesting_inner_wins_and_restores(spy) -> None:
    x, index = torch.randn(2, 4, 3), torch.tensor([0])
    fill = func.vmap(lambda r: r.index_fill(0, index, 1.0))
    with registry.use(pins={"index_fill": "test-spy"}):
        with registry.use(policy="native"):
            fill(x)
        assert spy == []
        fill(x)
        assert len(spy) == 1


def test_an_exception_inside_use_restores_the_outer_frame(spy) -> None:
    x, index = torch.randn(2, 4, 3), torch.tensor([0])
    fill = func.vmap(lambda r: r.index_fill(0, index, 1.0))
    with registry.use(pins={"index_fill": "test-spy"}):
        with pytest.raises(ValueError, match="boom"), registry.use(policy="native"):
            raise ValueError("boom")
        fill(x)
    assert len(spy) == 1
    fill(x)
    assert len(spy) == 1


def test_decorator_form(spy) -> None:
    @registry.use(pins={"index_fill": "test-spy"})
    def f(x):
        return func.vmap(lambda r: r.index_fill(0, torch.tensor([0]), 1.0))(x)

    f(torch.randn(2, 2, 2))
    f(torch.randn(2, 2, 2))
    assert len(spy) == 2
    assert not registry.routing_active()


def test_thread_local(spy) -> None:
    """Another thread, under vmap while this one is inside use(), runs PyTorch's own op."""
    inside, outside_done = threading.Event(), threading.Event()
    results = []

    def other_thread():
        inside.wait(10)
        x = torch.randn(3, 3, 3)
        results.append(func.vmap(lambda r: r.index_fill(0, torch.tensor([1]), 5.0))(x))
        assert not registry.routing_active()
        outside_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with registry.use(pins={"index_fill": "test-spy"}):
        inside.set()
        assert outside_done.wait(10), "the other thread did not run"
        func.vmap(lambda r: r.index_fill(0, torch.tensor([1]), 5.0))(torch.randn(3, 3, 3))  # this thread routes
    thread.join()
    assert len(results) == 1
    assert results[0][:, 1].eq(5.0).all()
    assert len(spy) == 1


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

    x = torch.randn(8, 5, 4, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    with registry.use():
        batched = func.vmap(func.grad(f))(x)
    expected = []
    for row in x:
        leaf = row.clone().requires_grad_()
        expected.append(torch.autograd.grad(f(leaf), leaf)[0])
    # float32 sums of 20 squares, accumulated in another order: a few ulps apart (1.5e-5 seen at values near 1).
    torch.testing.assert_close(batched, torch.stack(expected), rtol=1e-4, atol=1e-4)


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


def test_to_overloads_route() -> None:
    """Every Tensor.to overload reaches a kernel (to.dtype, to.device, to.dtype_layout) and keeps its meaning."""
    x = torch.randn(3, 2, 3, 4, 5)
    seen = []

    def f(r):
        seen.append(r.to(torch.float64).dtype)
        seen.append(r.to("cpu", torch.float64).dtype)
        seen.append(r.to(torch.zeros(1, dtype=torch.int32)).dtype)
        seen.append(r.to(memory_format=torch.channels_last).dtype)
        seen.append(r.to(torch.float32, False, True).dtype)
        return r.to(memory_format=torch.channels_last)

    with registry.use(pins={"to": "functional"}, record=True) as run:
        out = func.vmap(f)(x)
    assert seen == [torch.float64, torch.float64, torch.int32, torch.float32, torch.float32]
    assert {"to.dtype", "to.device", "to.dtype_layout"} <= set(run.calls)
    torch.testing.assert_close(out, x)
    with pytest.raises(RuntimeError, match="rank 4 tensor to use channels_last"):  # PyTorch alone: the 5-d batch
        func.vmap(lambda r: r.to(memory_format=torch.channels_last))(x)


def test_contiguous_channels_last_under_vmap() -> None:
    x = torch.randn(3, 2, 3, 4, 5)
    with pytest.raises(RuntimeError, match="NYI: querying is_contiguous"):
        func.vmap(lambda r: r.contiguous(memory_format=torch.channels_last))(x)
    with registry.use():
        out = func.vmap(lambda r: r.contiguous(memory_format=torch.channels_last))(x)
    torch.testing.assert_close(out, x)
    plain = torch.randn(2, 3, 4, 5)
    laid_out = plain.contiguous(memory_format=torch.channels_last)  # the Python path, outside any transform
    assert laid_out.is_contiguous(memory_format=torch.channels_last)
    assert laid_out.contiguous(memory_format=torch.channels_last) is laid_out
    assert plain.contiguous() is plain


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



def test_compiled_inside_use_is_retraced_outside(fallback_warnings) -> None:
    """A graph traced inside use() baked in a composite: called outside use(), it is traced again (and loops)."""
    torch._dynamo.reset()
    mask = torch.rand(4, 5) > 0.5
    x, source = torch.randn(4, 5), torch.randn(4, 5)
    compiled = torch.compile(func.vmap(lambda s, m, v: s.masked_scatter(m, v)), backend="aot_eager",
                             fullgraph=True)
    expected = _loop(lambda s, m, v: s.masked_scatter(m, v), x, mask, source)
    with registry.use():
        torch.testing.assert_close(compiled(x, mask, source), expected)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []
    torch.testing.assert_close(compiled(x, mask, source), expected)  # outside: PyTorch's own, traced again
    assert any("masked_scatter" in str(w.message) for w in fallback_warnings if FALLBACK in str(w.message))
    torch._dynamo.reset()


def test_compiled_outside_use_is_retraced_inside(fallback_warnings) -> None:
    torch._dynamo.reset()
    mask = torch.rand(4, 5) > 0.5
    x, source = torch.randn(4, 5), torch.randn(4, 5)
    compiled = torch.compile(func.vmap(lambda s, m, v: s.masked_scatter(m, v)), backend="aot_eager",
                             fullgraph=True)
    compiled(x, mask, source)
    assert any("masked_scatter" in str(w.message) for w in fallback_warnings if FALLBACK in str(w.message))
    fallback_warnings.clear()
    with registry.use(record=True) as run:
        out = compiled(x, mask, source)
    assert run.calls.get("masked_scatter", 0) >= 1  # traced again, through the kernel, inside use()
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []
    torch.testing.assert_close(out, _loop(lambda s, m, v: s.masked_scatter(m, v), x, mask, source))
    torch._dynamo.reset()


def test_derivative_op_masked_scatter_backward_under_vmap(capfd) -> None:
    """autograd calls masked_scatter_backward for the native op's gradient; under vmap it has no batching rule.

    Called through torch.ops, PyTorch reports its fallback as a C++ warning on stderr, not a Python warning.
    """
    grads = torch.randn(6, 3, 4, dtype=torch.float64)
    masks = torch.rand(6, 4) > 0.5  # broadcast against each sample's (3, 4)
    backward = func.vmap(torch.ops.aten.masked_scatter_backward, in_dims=(0, 0, None))
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        capfd.readouterr()
        native = backward(grads, masks, [12])
        assert "batching rule for aten::masked_scatter_backward" in capfd.readouterr().err
        with registry.use(record=True) as run:
            routed = backward(grads, masks, [12])
        assert FALLBACK not in capfd.readouterr().err
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    assert run.calls["masked_scatter_backward"] == 1
    torch.testing.assert_close(routed, native)
    torch.testing.assert_close(routed, _loop(lambda g, m: torch.ops.aten.masked_scatter_backward(g, m, [12]),
                                             grads, masks))


def test_eager_autograd_index_fill_negative_index_with_tensor_value() -> None:
    """PyTorch's own derivative of a tensor value fails on a negative index, even in eager autograd."""

    def grads():
        x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        value = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        out = x.index_fill(0, torch.tensor([-1]), value)
        (out * out).sum().backward()
        return x, value

    with pytest.raises(IndexError, match="index out of range"):
        grads()
    with registry.use(record=True) as run:
        x, value = grads()
    assert run.calls["index_fill.int_Tensor"] == 1
    expected_x = 2 * x.detach()
    expected_x[-1] = 0
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(value.grad, torch.tensor(2 * 2.0 * 3, dtype=torch.float64))


def test_eager_autograd_kernel_passes_through_without_grad(spy) -> None:
    x, value = torch.randn(4, 3), torch.tensor(2.0)
    with registry.use(pins={"index_fill": "test-spy"}, record=True) as run:
        x.index_fill(0, torch.tensor([-1]), value)
    assert spy == [] and run.decisions == [] and run.calls == {}


def test_wrapped_numbers_reach_pytorchs_kernel() -> None:
    """C++ wraps Python scalars in 0-d tensors that reach a Python kernel as numbers (``to`` on one, under nested
    vmap after Dynamo has been imported): they go back to PyTorch's kernel as tensors, inside use() and outside."""
    from registry.core.routing import _rewrapped  # noqa: PLC2701 - a test of the module's own helper

    assert _rewrapped((2, torch.float32), (0,))[0].dtype == torch.int64
    assert _rewrapped((2.5,), (0,))[0].dtype == torch.float64
    assert _rewrapped((True,), (0,))[0].dtype == torch.bool
    x = torch.randn(3)
    assert _rewrapped((x, 1), (0,)) is None
    fill = torch.ops.aten.to.dtype
    out = func.vmap(lambda r: fill(r, torch.float64))(torch.randn(2, 3))
    assert out.dtype == torch.float64
    with registry.use():
        assert func.vmap(func.vmap(lambda r: r * 2))(torch.ones(2, 3, 4)).eq(2).all()


def test_first_routed_call_of_a_process_can_be_under_vmap(routing_backend: str) -> None:
    """The first decision reads the store's evidence, which imports the harness; that import must not run under
    vmap (it once built samples with torch.randn there: 'called random operation while in randomness error mode')."""
    import os
    import subprocess
    import sys

    code = ("import torch, registry\n"
            "from torch import func\n"
            "x = torch.randn(4, 5)\n"
            "with registry.use():\n"
            "    y = func.vmap(func.grad(lambda r: r.index_add(0, torch.tensor([1]), r[:1]).pow(2).sum()))(x)\n"
            "print(tuple(y.shape))\n")
    env = {**os.environ, routing.BACKEND_ENV: routing_backend}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "(4, 5)"


def test_a_recording_block_nested_in_another_records_into_both() -> None:
    """The inner block's run holds its own decisions; the enclosing run sees them too, and its own."""
    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.5
    with registry.use(record=True) as outer:
        func.vmap(lambda s, m: s.masked_fill(m, 1.0))(x, mask)
        with registry.use(record=True) as inner:
            func.vmap(lambda s: s.index_fill(0, torch.tensor([1]), 2.0))(x)
    assert [d.op for d in inner.decisions] == ["index_fill"]
    assert [d.op for d in outer.decisions] == ["masked_fill", "index_fill"]
    assert outer.decisions[1] is inner.decisions[0]
    assert outer.calls == {"masked_fill.Scalar": 1, "index_fill.int_Scalar": 1}
