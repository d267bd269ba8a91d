"""composites/index.py: where the index family's composites replace PyTorch's own op (NOTE [index_add's batched
index])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.func import grad, hessian, jacfwd, vmap
from torch.utils._pytree import tree_leaves  # noqa: PLC2701 - PyTorch's pytree

import registry
from composites.our_ops import OPS as CPP_OPS
from registry.harness.fallback import KernelCalls

NODES, EDGES, FEATURES, BATCH = 6, 9, 4, 5


def _aggregate(messages: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A graph layer's sum of messages into a fresh buffer, then a loss."""
    return (torch.zeros(NODES, FEATURES, dtype=messages.dtype).index_add(0, target, messages) * weight).sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    messages = torch.randn(BATCH, EDGES, FEATURES, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, NODES, (BATCH, EDGES), generator=generator)
    return messages, targets, torch.randn(NODES, FEATURES, generator=generator, dtype=torch.float64)


def test_index_add_with_a_batched_index_runs_the_rows_op_inside_use() -> None:
    """Natively functorch calls index_add once per sample; inside use() under vmap(grad) one folded scatter_rows
    forward and one folded gather_rows backward (rows.cpp, NOTE [rows ops]), and the per-sample gradients equal
    autograd's one sample at a time. Under plain vmap the scatter_add composite: one call."""
    messages, targets, weight = _inputs()
    step = vmap(grad(_aggregate), in_dims=(0, 0, None))
    with KernelCalls() as native_calls:
        step(messages, targets, weight)
    assert native_calls.of("index_add") == BATCH
    with registry.use(record=True) as block:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            result = step(messages, targets, weight)
    ran = {event.key: event.count for event in profile.key_averages()}
    assert [(d.op, d.kind) for d in block.decisions] == [("index_add", "cpp_op")]
    # Each once at the vmap level and once, folded, under it.
    assert ran["multicomposite::scatter_rows"] == 2 and ran["multicomposite::gather_rows"] == 2
    assert "aten::index_add_" not in ran and "aten::gather" not in ran
    for b in range(BATCH):
        sample = messages[b].clone().requires_grad_()
        (expected,) = torch.autograd.grad(_aggregate(sample, targets[b], weight), sample)
        torch.testing.assert_close(result[b], expected)
    with registry.use(record=True) as block, KernelCalls() as routed_calls:
        vmap(_aggregate, in_dims=(0, 0, None))(messages, targets, weight)
    assert [(d.op, d.kind) for d in block.decisions] == [("index_add", "functional")]
    assert routed_calls.of("index_add") == 0 and routed_calls.of("scatter_add") == 1


def test_index_add_with_an_unbatched_index_stays_native() -> None:
    """The index the samples share, under vmap and vmap(grad): functorch's rule makes one call, and PyTorch's op is
    kept (the rows op is slower there: the preference's docstring)."""
    messages, targets, weight = _inputs()
    with registry.use(record=True) as block:
        vmap(_aggregate, in_dims=(0, None, None))(messages, targets[0], weight)
        vmap(grad(_aggregate), in_dims=(0, None, None))(messages, targets[0], weight)
    assert [(d.op, d.stack, d.kind) for d in block.decisions] == [("index_add", ("vmap",), "native"),
                                                                  ("index_add", ("vmap", "grad"), "native")]


def _aggregate_in_place(messages: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The in-place form graph libraries write, into a buffer of the weight (batched inside use())."""
    out = weight.new_zeros(NODES, FEATURES)
    out.index_add_(0, target, messages)
    return (out * weight).square().sum()


_STACKS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]] = {
    "vmap(grad)": lambda m, t, w: vmap(grad(_aggregate, argnums=(0, 2)), in_dims=(0, 0, None))(m, t, w),
    "vmap(grad) in place": lambda m, t, w: vmap(grad(_aggregate_in_place), in_dims=(0, 0, None))(m, t, w),
    "vmap(grad) shared index": lambda m, t, w: vmap(grad(_aggregate), in_dims=(0, None, None))(m, t[0], w),
    "vmap(grad) shared messages": lambda m, t, w: vmap(grad(_aggregate, argnums=2), in_dims=(None, 0, None))(
        m[0], t, w),
    "vmap(vmap(grad))": lambda m, t, w: vmap(vmap(grad(_aggregate), in_dims=(0, 0, None)), in_dims=(0, 0, None))(
        m[:4].view(2, 2, EDGES, FEATURES), t[:4].view(2, 2, EDGES), w),
    "vmap(jacfwd)": lambda m, t, w: vmap(jacfwd(_aggregate), in_dims=(0, 0, None))(m, t, w),
    "vmap(hessian)": lambda m, t, w: vmap(hessian(lambda x, j: _aggregate(x, j, w).square()), in_dims=(0, 0))(
        m[:, :3], t[:, :3]),
}


@pytest.mark.parametrize("stack", list(_STACKS))
def test_pinned_rows_op_equals_pytorchs_index_add(stack: str) -> None:
    """Pinned, index_add's cpp_op runs under every stack (scatter_rows and gather_rows are each other's backward,
    differentiable again, with tangents) and gives PyTorch's values."""
    messages, targets, weight = _inputs()
    if "in place" in stack:  # natively vmap refuses the write into the weight's buffer: use()'s batched buffers
        with registry.use(pins={"index_add": "native"}):
            native = _STACKS[stack](messages, targets, weight)
    else:
        native = _STACKS[stack](messages, targets, weight)
    with registry.use(pins={"index_add": "cpp_op"}, record=True) as block:
        got = _STACKS[stack](messages, targets, weight)
    assert {d.kind for d in block.decisions if d.op == "index_add"} == {"cpp_op"}
    for mine, theirs in zip(tree_leaves(got), tree_leaves(native), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_index_add_the_rows_op_does_not_take_is_pytorchs() -> None:
    """Another dimension, alpha, a bool self: PyTorch's own index_add; an index out of bounds is PyTorch's error."""
    entry = CPP_OPS.get().index_add.entry
    self, source = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    index = torch.tensor([0, 3])
    torch.testing.assert_close(entry(self, 1, index, source), self.index_add(1, index, source))
    torch.testing.assert_close(entry(self, 0, index[:1] % 3, source[:1].repeat(1, 2), alpha=2.5),
                               self.index_add(0, index[:1] % 3, source[:1].repeat(1, 2), alpha=2.5))
    flags = torch.tensor([True, False, False])
    assert torch.equal(entry(flags, 0, torch.tensor([1]), torch.tensor([True])),
                       flags.index_add(0, torch.tensor([1]), torch.tensor([True])))
    rows = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="index 3 is out of bounds for dimension 0 with size 3"):
        entry(self, 0, index, rows)
    with pytest.raises(RuntimeError, match="index 3 is out of bounds for dimension 0 with size 3"):
        self.index_add(0, index, rows)  # PyTorch's, the same error


@pytest.mark.usefixtures("cpp_routing")
def test_a_routed_in_place_call_runs_the_rows_op_without_python(python_calls: Any) -> None:
    """``out.index_add_(...)`` routed to the cpp_op composite: the C++ routing calls multicomposite::index_add.entry
    and copies its result into ``out`` (routing.cpp's call_redirect), the composite's Python function never runs, and
    the per-sample gradients equal the loop's."""
    import composites.our_ops

    messages, targets, weight = _inputs()
    step = vmap(grad(_aggregate_in_place), in_dims=(0, 0, None))
    with registry.use(record=True) as block:
        step(messages, targets, weight)
    assert {(d.op, d.kind) for d in block.decisions if d.op == "index_add"} == {("index_add", "cpp_op")}
    calls = python_calls(composites.our_ops.OPS)
    with registry.use(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = step(messages, targets, weight)
    assert "multicomposite::index_add" in {event.key for event in profile.key_averages()}
    assert calls == []
    for b in range(BATCH):
        sample = messages[b].clone().requires_grad_()
        (expected,) = torch.autograd.grad(_aggregate_in_place(sample, targets[b], weight), sample)
        torch.testing.assert_close(got[b], expected)


def test_index_add_over_no_samples_inside_use() -> None:
    """vmap over zero samples: the rows op returns the empty batch (PyTorch's vmap loop raises there, stacking no
    results; a reshape to (-1) of the empty batch was ambiguous in the entry)."""
    messages = torch.zeros(0, EDGES, FEATURES, dtype=torch.float64)
    targets = torch.zeros(0, EDGES, dtype=torch.long)
    weight = torch.ones(NODES, FEATURES, dtype=torch.float64)
    with registry.use(record=True) as block:
        got = vmap(grad(_aggregate), in_dims=(0, 0, None))(messages, targets, weight)
    assert [(d.op, d.kind) for d in block.decisions] == [("index_add", "cpp_op")]
    assert got.shape == (0, EDGES, FEATURES)
