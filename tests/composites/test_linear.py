"""linear's C++ op (composites/linear.py, registry/core/kernels/linear.cpp): chosen under vmap(grad), equal to
PyTorch's linear and to the per-sample loop under every stack it may be pinned to, and reached from the C++ routing
without entering Python."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.func import functional_call, functionalize, grad, hessian, jacfwd, jacrev, vmap
from torch.utils._pytree import tree_leaves  # noqa: PLC2701 - PyTorch's pytree

import composites.linear
import registry
from registry.core.registration import RegistrationError, register
from registry.core.selector import SelectionError
from tests.composites.test_reduce import no_vmap_fallback

BATCH = 5


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(BATCH, 3, 4, generator=generator, dtype=torch.float64),
            torch.randn(6, 4, generator=generator, dtype=torch.float64),
            torch.randn(6, generator=generator, dtype=torch.float64))


def _f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return (F.linear(x, w, b).tanh() ** 2).sum()


def _linear_decisions(run: Any) -> set[tuple[tuple[str, ...], str]]:
    return {(d.stack, d.kind) for d in run.decisions if d.op == "linear"}


class _Adapted(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA), over 3-d inputs: what the op serves most."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 6).double().requires_grad_(False)
        self.down, self.up = nn.Linear(4, 2, bias=False).double(), nn.Linear(2, 6).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def test_per_sample_gradients_run_the_cpp_op_and_equal_the_loop() -> None:
    torch.manual_seed(0)
    model = _Adapted()
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    x, _, _ = _data()

    def loss(p: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (sample.unsqueeze(0),)).sin().sum()

    loop = [torch.autograd.grad(model(x[b:b + 1]).sin().sum(), [model.down.weight, model.up.weight, model.up.bias])
            for b in range(BATCH)]
    with no_vmap_fallback(), registry.use(record=True) as run:
        got = vmap(grad(loss), in_dims=(None, 0))(params, x)
    assert _linear_decisions(run) == {(("vmap", "grad"), "cpp_op")}
    for i, name in enumerate(("down.weight", "up.weight", "up.bias")):
        torch.testing.assert_close(got[name], torch.stack([each[i] for each in loop]))


def test_plain_vmap_and_grad_keep_pytorchs_linear() -> None:
    x, w, b = _data()
    with registry.use(record=True) as run:
        vmap(F.linear, in_dims=(0, None, None))(x, w, b)
        grad(_f, argnums=1)(x[0], w, b)
    assert {kind for _, kind in _linear_decisions(run)} == {"native"}


_STACKS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]] = {
    "vmap(grad)": lambda x, w, b: vmap(grad(_f, argnums=(0, 1, 2)), in_dims=(0, None, None))(x, w, b),
    "vmap(grad) ensemble": lambda x, w, b: vmap(grad(_f, argnums=(1, 2)), in_dims=(None, 0, 0))(
        x[0], w.expand(3, 6, 4).clone(), b.expand(3, 6).clone()),
    "vmap(grad) 1-d input": lambda x, w, b: vmap(grad(_f, argnums=(0, 1, 2)), in_dims=(0, None, None))(x[:, 0], w, b),
    "vmap(grad) no bias": lambda x, w, _: vmap(grad(_f, argnums=(0, 1)), in_dims=(0, None, None))(x, w, None),
    "vmap(vmap(grad))": lambda x, w, b: vmap(vmap(grad(_f, argnums=(1, 2)), in_dims=(0, None, None)),
                                             in_dims=(0, None, None))(x, w, b),
    "vmap(jacrev)": lambda x, w, b: vmap(jacrev(lambda *a: F.linear(*a).sin(), argnums=(1, 2)),
                                         in_dims=(0, None, None))(x, w, b),
    "vmap(jacfwd)": lambda x, w, b: vmap(jacfwd(_f, argnums=(0, 1, 2)), in_dims=(0, None, None))(x, w, b),
    "hessian": lambda x, w, b: hessian(_f, argnums=1)(x[0], w, b),
    "vmap(hessian)": lambda x, w, b: vmap(hessian(_f, argnums=1), in_dims=(0, None, None))(x, w, b),
    "grad(grad)": lambda x, w, b: grad(lambda v: grad(_f, argnums=1)(x[0], v, b).sum())(w),
    "vmap(functionalize(grad))": lambda x, w, b: vmap(functionalize(grad(_f, argnums=1)), in_dims=(0, None, None))(
        x, w, b),
}


@pytest.mark.parametrize("stack", list(_STACKS))
def test_pinned_cpp_op_equals_pytorch_and_the_loop(stack: str) -> None:
    """Pinned, the op runs under every stack (its backward differentiates again, its tangent is aten ops) and gives
    PyTorch's linear's values; the per-sample ones equal a loop over the batch outside any transform."""
    x, w, b = _data()
    native = _STACKS[stack](x, w, b)
    with registry.use(pins={"linear": "cpp_op"}, record=True) as run:
        got = _STACKS[stack](x, w, b)
    assert {kind for _, kind in _linear_decisions(run)} == {"cpp_op"}
    # Ran as written: nothing refused under vmap and was retried functionalized (a write of the op's batching rule
    # into its own output, where an operand is still batched at an outer level, would be).
    if "functionalize" not in stack:
        assert all("functionalize" not in each for each, _ in _linear_decisions(run))
    for mine, theirs in zip(tree_leaves(got), tree_leaves(native), strict=True):
        torch.testing.assert_close(mine, theirs)
    if stack == "vmap(grad)":
        for i, sample in enumerate(x):
            leaves = [sample.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
            expected = torch.autograd.grad(_f(*leaves), leaves)
            for mine, theirs in zip(got, expected, strict=True):
                torch.testing.assert_close(mine[i], theirs)


def test_eager_autograd_through_per_sample_gradients() -> None:
    """A weight that requires grad outside the transforms: eager autograd differentiates the op's backward."""
    x, w, b = _data()

    def outer(weight: torch.Tensor) -> torch.Tensor:
        per_sample = vmap(grad(_f, argnums=1), in_dims=(0, None, None))(x, weight, b)
        return torch.autograd.grad(per_sample.square().sum(), weight)[0]

    native = outer(w.clone().requires_grad_())
    with registry.use(pins={"linear": "cpp_op"}):
        got = outer(w.clone().requires_grad_())
    torch.testing.assert_close(got, native)


@pytest.mark.usefixtures("cpp_routing")
def test_the_routing_calls_the_op_without_python(python_calls: Any) -> None:
    """The composite is the op on the call's own arguments (register(..., redirect=)): the C++ routing calls the
    op, and the composite's Python function runs only where the Python routing does."""
    calls = python_calls(composites.linear.CPP_OPS)
    x, w, b = _data()
    with registry.use(record=False):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            vmap(grad(_f, argnums=1), in_dims=(0, None, None))(x, w, b)
    assert "multicomposite::linear" in {event.key for event in profile.key_averages()}
    assert calls == []


def test_redirect_is_for_cpp_op_composites_only() -> None:
    with pytest.raises(RegistrationError, match="only a cpp_op composite"):
        register("linear", "functional", name="not_a_cpp_op", redirect="multicomposite::linear")(
            lambda input, weight, bias=None: F.linear(input, weight, bias))


def test_the_op_refuses_a_1d_weight_and_the_rule_keeps_pytorchs_linear() -> None:
    x, w, _ = _data()
    with pytest.raises(RuntimeError, match="takes a 2-d weight"):
        composites.linear.CPP_OPS.get().linear(x.clone().requires_grad_(), w[0], None)
    with registry.use(pins={"linear": "cpp_op"}), pytest.raises(SelectionError, match="2-d weight"):
        vmap(grad(lambda v, u: F.linear(v, u).sum()), in_dims=(0, None))(x.detach(), w[0])
    with registry.use(record=True) as run:
        got = vmap(grad(lambda v, u: F.linear(v, u).sum()), in_dims=(0, None))(x.detach(), w[0])
    assert {kind for _, kind in _linear_decisions(run)} == {"native"}
    torch.testing.assert_close(got, w[0].expand_as(x))


def test_a_decision_for_a_2d_weight_never_serves_a_1d_one() -> None:
    """The selector's cache keys each per-sample dimension's bit length (as the C++ routing's key does): a decision
    kept for the adapter's (2, 4) weight over a (1, 3, 4) input must not serve a (4,) weight over a (3, 4) input,
    where the op's rule refuses (the same number of elements, the same stack and batching)."""
    test_per_sample_gradients_run_the_cpp_op_and_equal_the_loop()
    x, w, _ = _data()
    with registry.use(pins={"linear": "cpp_op"}), pytest.raises(SelectionError, match="2-d weight"):
        vmap(grad(lambda v, u: F.linear(v, u).sum()), in_dims=(0, None))(x, w[0])
    with registry.use(record=True) as run:
        got = vmap(grad(lambda v, u: F.linear(v, u).sum()), in_dims=(0, None))(x, w[0])
    assert {kind for _, kind in _linear_decisions(run)} == {"native"}
    torch.testing.assert_close(got, w[0].expand_as(x))


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("batch_last", [False, True], ids=["batch-first", "batch-last"])
@pytest.mark.parametrize("rows", [1, 3])
def test_per_sample_weight_gradients_equal_the_loop(rows: int, batch_last: bool) -> None:
    """Where nothing differentiates the backward again, each sample's weight gradient is multicomposite's
    linear_weight_grad: a broadcasting multiply where a sample is one row (no bmm with a contracted size of 1), one
    bmm over the samples' rows otherwise; also where the batch is the input's innermost dimension in memory (vmap
    over its last dimension), which the one-row product copies to contiguous operands first."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(BATCH, rows, 4, generator=generator, dtype=torch.float64)
    w, b = torch.randn(6, 4, generator=generator, dtype=torch.float64), torch.randn(6, generator=generator,
                                                                                    dtype=torch.float64)
    step = vmap(grad(_f, argnums=(1, 2)), in_dims=(2 if batch_last else 0, None, None))
    batched_x = x.permute(1, 2, 0).contiguous() if batch_last else x
    with no_vmap_fallback(), registry.use(record=True) as run:
        got = step(batched_x, w, b)
    assert _linear_decisions(run) == {(("vmap", "grad"), "cpp_op")}
    with registry.use(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step(batched_x, w, b)
    ran = {event.key for event in profile.key_averages()}
    assert "multicomposite::linear_weight_grad" in ran
    assert ("aten::bmm" in ran) == (rows > 1)
    for i in range(BATCH):
        leaves = [w.clone().requires_grad_(), b.clone().requires_grad_()]
        expected = torch.autograd.grad(_f(x[i], *leaves), leaves)
        torch.testing.assert_close(got[0][i], expected[0])
        torch.testing.assert_close(got[1][i], expected[1])


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("case", ["one-row", "rows", "batch-last", "scalar-bias", "ensemble"])
def test_first_order_input_and_bias_gradients_are_one_call(case: str) -> None:
    """Where nothing records the backward, LinearBackward's input and bias gradients are one call of
    multicomposite's linear_backward (linear.cpp's NOTE): its rule folds the samples' rows into one product and sums
    each sample's rows for the bias (a view where a sample is one row); a bias of another shape than (out) and a
    batched weight (an ensemble) run aten's ops on the batched tensors. Every gradient equals the per-sample loop's."""
    generator = torch.Generator().manual_seed(7)
    rows = 1 if case == "one-row" else 3
    x = torch.randn(BATCH, rows, 4, generator=generator, dtype=torch.float64)
    w, b = torch.randn(6, 4, generator=generator, dtype=torch.float64), torch.randn(6, generator=generator,
                                                                                    dtype=torch.float64)
    if case == "scalar-bias":
        b = b[0].clone()
    in_dims: tuple[int | None, ...] = (0, None, None)
    batched = [x, w, b]
    if case == "batch-last":
        in_dims, batched[0] = (2, None, None), x.permute(1, 2, 0).contiguous()
    elif case == "ensemble":
        in_dims = (0, 0, 0)
        batched[1] = w + torch.arange(BATCH, dtype=torch.float64).view(BATCH, 1, 1) / 10
        batched[2] = b + torch.arange(BATCH, dtype=torch.float64).view(BATCH, 1) / 10
    step = vmap(grad(_f, argnums=(0, 1, 2)), in_dims=in_dims)
    with registry.use(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = step(*batched)
    assert "multicomposite::linear_backward" in {event.key for event in profile.key_averages()}
    for i in range(BATCH):
        leaves = [x[i].clone().requires_grad_(),
                  *((t[i] if case == "ensemble" else t).clone().requires_grad_() for t in batched[1:])]
        expected = torch.autograd.grad(_f(*leaves), leaves)
        for got_one, want in zip(got, expected, strict=True):
            torch.testing.assert_close(got_one[i], want)


@pytest.mark.usefixtures("cpp_routing")
def test_linear_backward_refuses_to_be_differentiated() -> None:
    """The first-order backward op has no derivative: called where grad mode records, it says so."""
    generator = torch.Generator().manual_seed(8)
    g = torch.randn(3, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="linear_backward has no derivative"):
        torch.ops.multicomposite.linear_backward(g, w, True, [6])
    with torch.no_grad():
        grad_input, grad_bias = torch.ops.multicomposite.linear_backward(g, w, True, [6])
    torch.testing.assert_close(grad_input, g.detach() @ w)
    torch.testing.assert_close(grad_bias, g.detach().sum(0))


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("width", [128, 131], ids=["rows-aligned", "rows-unaligned"])
def test_large_one_row_weight_gradients_equal_the_loop(width: int) -> None:
    """float32 per-sample weight gradients of 4 MiB and more are written with streaming stores (linear.cpp's NOTE),
    with rows that start on a 32-byte boundary and rows that do not (131 floats): each equals the per-sample loop's."""
    generator = torch.Generator().manual_seed(6)
    batch, out = 64, 128
    x = torch.randn(batch, width, generator=generator)
    w, b = torch.randn(out, width, generator=generator) / 10, torch.randn(out, generator=generator)
    assert batch * out * width * 4 >= 4 << 20  # past the streaming threshold
    with registry.use():
        got = vmap(grad(lambda xs, v, c: F.linear(xs, v, c).tanh().sum(), argnums=1), in_dims=(0, None, None))(x, w, b)
    for i in range(batch):
        leaf = w.clone().requires_grad_()
        torch.testing.assert_close(got[i], torch.autograd.grad(F.linear(x[i], leaf, b).tanh().sum(), leaf)[0])


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("rows", [1, 3])
def test_an_input_the_samples_share_gets_one_product_per_sample(rows: int) -> None:
    """A linear whose input the samples share (an LSTM's initial hidden state) and whose output gradient is per
    sample: the op runs, and each sample's weight gradient is one outer product (one bmm over its rows), not aten's mm
    of (B * out, 1) x (1, in); each equals the per-sample loop's."""
    generator = torch.Generator().manual_seed(7)
    shared = torch.randn(rows, 4, generator=generator, dtype=torch.float64)
    x = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
    w = torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def loss(v: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return (F.linear(shared, v) * sample).tanh().sum()

    step = vmap(grad(loss), in_dims=(None, 0))
    with registry.use(record=True) as run, torch.profiler.profile(record_shapes=True) as profile:
        got = step(w, x)
    assert _linear_decisions(run) == {(("vmap", "grad"), "cpp_op")}
    ran = [(event.name, event.input_shapes) for event in profile.events()]
    assert ("multicomposite::linear_weight_grad", [[rows, 6], [rows, 4]]) in ran
    # The forward's own mm ((rows, 4) x (4, 6), shared) is there; no product has the samples' gradients as its rows.
    assert not [shapes for name, shapes in ran if name == "aten::mm" and shapes[0][0] == BATCH * 6]
    for i in range(BATCH):
        leaf = w.clone().requires_grad_()
        torch.testing.assert_close(got[i], torch.autograd.grad(loss(leaf, x[i]), leaf)[0])


def _elman(wi: torch.Tensor, wh: torch.Tensor, b: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """An Elman recurrence written with F.linear, one sample (T, in): both weights used at every step."""
    h = torch.zeros(1, wh.shape[0], dtype=xs.dtype)
    for t in range(xs.shape[0]):
        h = torch.tanh(F.linear(xs[t:t + 1], wi, b) + F.linear(h, wh))
    return h.square().sum()


def _recurrence_data() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    return tuple(torch.randn(*shape, generator=generator, dtype=torch.float64)
                 for shape in ((BATCH, 6, 3), (4, 3), (4, 4), (4,)))


@pytest.mark.usefixtures("cpp_routing")
def test_a_weight_used_at_every_step_gets_one_product_per_sample() -> None:
    """A weight used at T steps: its per-sample gradient is formed once from the T steps' rows (one linear_weight_grad
    call per weight), not T products summed by autograd; equal to the per-sample loop."""
    x, wi, wh, b = _recurrence_data()
    step = vmap(grad(_elman, argnums=(0, 1, 2)), in_dims=(None, None, None, 0))
    with registry.use(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = step(wi, wh, b, x)
    calls = {event.key: event.count for event in profile.key_averages()}
    assert calls["multicomposite::linear_weight_grad"] == 2  # wi's and wh's, each over the 6 steps
    for i in range(BATCH):
        leaves = [wi.clone().requires_grad_(), wh.clone().requires_grad_(), b.clone().requires_grad_()]
        expected = torch.autograd.grad(_elman(*leaves, x[i]), leaves)
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine[i], theirs)


@pytest.mark.parametrize("stack", ["vmap(hessian)", "grad(grad)", "vmap(jacrev)"])
def test_a_recurrence_differentiated_again_equals_pytorch(stack: str) -> None:
    """Where the backward is differentiated again, the weight's gradient node uses aten's ops (cat, mm): its own
    derivative is PyTorch's."""
    x, wi, wh, b = _recurrence_data()
    run = {
        "vmap(hessian)": lambda: vmap(hessian(_elman, argnums=1), in_dims=(None, None, None, 0))(wi, wh, b, x),
        "grad(grad)": lambda: grad(lambda v: grad(_elman, argnums=1)(wi, v, b, x[0]).sum())(wh),
        "vmap(jacrev)": lambda: vmap(jacrev(_elman, argnums=(0, 1)), in_dims=(None, None, None, 0))(wi, wh, b, x),
    }[stack]
    native = run()
    with registry.use(pins={"linear": "cpp_op"}):
        got = run()
    for mine, theirs in zip(tree_leaves(got), tree_leaves(native), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_a_use_off_the_backwards_path_gives_no_rows() -> None:
    """The weight feeds the loss and an auxiliary output: only the loss's calls reach the weight's gradient node, whose
    other input stays empty; the gradient is the loss's alone."""
    x, w, b = _data()

    def loss(weight: torch.Tensor, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(sample, weight, b).sin().sum(), F.linear(sample.cos(), weight)

    step = vmap(grad(loss, has_aux=True), in_dims=(None, 0))
    native = step(w, x)
    with registry.use(pins={"linear": "cpp_op"}):
        got = step(w, x)
    torch.testing.assert_close(got[0], native[0])
    torch.testing.assert_close(got[1], native[1])
