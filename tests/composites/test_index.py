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
    """Natively functorch calls index_add once per sample; inside use() under vmap(grad) one folded add_rows
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
    assert ran["multicomposite::add_rows"] == 2 and ran["multicomposite::gather_rows"] == 2
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
    """Pinned, index_add's cpp_op runs under every stack (add_rows' source gradient is gather_rows, whose backward
    is scatter_rows: differentiable again, with tangents) and gives PyTorch's values."""
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
    """``out.index_add_(...)`` routed to the cpp_op composite: the C++ routing calls the entry's in-place twin,
    multicomposite::index_add_.entry (routing.cpp's call_redirect), which adds the rows into ``out`` in place
    (add_rows_: no copy_, one autograd node), the composite's Python function never runs, and the per-sample gradients
    equal the loop's."""
    import composites.our_ops

    messages, targets, weight = _inputs()
    step = vmap(grad(_aggregate_in_place), in_dims=(0, 0, None))
    with registry.use(record=True) as block:
        step(messages, targets, weight)
    assert {(d.op, d.kind) for d in block.decisions if d.op == "index_add"} == {("index_add", "cpp_op")}
    calls = python_calls(composites.our_ops.OPS)
    with registry.use(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = step(messages, targets, weight)
    ran = {event.key: event.count for event in profile.key_averages()}
    assert ran["multicomposite::index_add_"] == 1 and ran["multicomposite::add_rows_"] == 2  # the level's, folded
    assert "multicomposite::index_add" not in ran  # not the out-of-place entry and a copy
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


# --- multicomposite::add_rows: self plus rows summed at an index (registry/core/kernels/rows.cpp) -------------------

def _add_rows_data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    index = torch.randint(0, NODES, (BATCH, EDGES), generator=generator)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(BATCH, NODES, FEATURES, generator=generator, dtype=dtype), index,
                torch.randn(BATCH, EDGES, FEATURES, generator=generator, dtype=dtype))
    return (torch.randint(-9, 9, (BATCH, NODES, FEATURES), generator=generator, dtype=dtype), index,
            torch.randint(-9, 9, (BATCH, EDGES, FEATURES), generator=generator, dtype=dtype))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.int64, torch.complex64), ids=str)
def test_add_rows_is_index_add(dtype: torch.dtype) -> None:
    """Eagerly (a conjugate self too) and under vmap with whatever is batched: PyTorch's index_add of each sample."""
    add_rows = CPP_OPS.get().add_rows
    selfs, index, sources = _add_rows_data(dtype)
    torch.testing.assert_close(add_rows(selfs[0], sources[0], index[0]), selfs[0].index_add(0, index[0], sources[0]))
    if dtype.is_complex:
        conjugate = selfs[0].conj()
        torch.testing.assert_close(add_rows(conjugate, sources[0], index[0]),
                                   conjugate.resolve_conj().index_add(0, index[0], sources[0]))
    cases = {"all batched": (0, 0, 0), "shared self": (None, 0, 0), "shared source": (0, 0, None),
             "shared index": (0, None, 0)}
    for name, in_dims in cases.items():
        args = [t if d == 0 else t[0] for t, d in zip((selfs, index, sources), in_dims, strict=True)]
        got = vmap(lambda s, j, x: add_rows(s, x, j), in_dims=in_dims)(*args)
        want = torch.stack([(s if in_dims[0] == 0 else args[0]).index_add(
            0, j if in_dims[1] == 0 else args[1], x if in_dims[2] == 0 else args[2])
            for s, j, x in zip(selfs, index, sources, strict=True)])
        torch.testing.assert_close(got, want, msg=name)


def test_add_rows_nested_vmap_and_an_index_batched_at_both_levels() -> None:
    """vmap(vmap): the inner level's index is batched at the outer level too (its values cannot be read there), and
    the op decomposes into scatter_rows and an add, whose rules take it."""
    add_rows = CPP_OPS.get().add_rows
    selfs, index, sources = _add_rows_data()
    selfs, index, sources = (t[:4].reshape(2, 2, *t.shape[1:]) for t in (selfs, index, sources))
    got = vmap(vmap(lambda s, j, x: add_rows(s, x, j)))(selfs, index, sources)
    want = torch.stack([torch.stack([selfs[a, b].index_add(0, index[a, b], sources[a, b]) for b in range(2)])
                        for a in range(2)])
    torch.testing.assert_close(got, want)


def test_add_rows_gradients_and_tangents() -> None:
    """Its node: the output's gradient for self, gather_rows of it for the source, twice differentiable; its
    forward-AD tangent with either tangent alone or both."""
    add_rows = CPP_OPS.get().add_rows
    selfs, index, sources = _add_rows_data()
    self0, source0 = selfs[0].requires_grad_(), sources[0].requires_grad_()
    assert torch.autograd.gradcheck(lambda s, x: add_rows(s, x, index[0]), (self0, source0))
    assert torch.autograd.gradgradcheck(lambda s, x: add_rows(s, x, index[0]).square(), (self0, source0))
    s, x = selfs[0].detach(), sources[0].detach()
    ts, tx = torch.randn_like(s), torch.randn_like(x)
    for tangents in ((ts, tx), (ts, torch.zeros_like(tx)), (torch.zeros_like(ts), tx)):
        _, got = torch.func.jvp(lambda a, b: add_rows(a, b, index[0]), (s, x), tangents)
        _, want = torch.func.jvp(lambda a, b: a.index_add(0, index[0], b), (s, x), tangents)
        torch.testing.assert_close(got, want)
    _, got = torch.func.jvp(lambda a: add_rows(a, x, index[0]), (s,), (ts,))
    torch.testing.assert_close(got, ts)
    _, got = torch.func.jvp(lambda b: add_rows(s, b, index[0]), (x,), (tx,))
    torch.testing.assert_close(got, torch.zeros_like(s).index_add(0, index[0], tx))


def test_add_rows_refuses_what_it_does_not_take() -> None:
    """Its own errors for arguments it does not take; an index out of bounds is index_add's error, under vmap too."""
    add_rows = CPP_OPS.get().add_rows
    selfs, index, sources = _add_rows_data()
    with pytest.raises(RuntimeError, match="at least one dimension"):
        add_rows(torch.tensor(1.0), torch.randn(3), torch.tensor([0, 0, 0]))
    with pytest.raises(RuntimeError, match="source's dtype Float must be self's, Double"):
        add_rows(selfs[0], sources[0].float(), index[0])
    with pytest.raises(RuntimeError, match="must be the index's"):
        add_rows(selfs[0], sources[0][:, :2], index[0])
    with pytest.raises(RuntimeError, match="int64 or int32 CPU index"):
        add_rows(selfs[0], sources[0], index[0].double())
    index[2, 3] = NODES
    message = f"index {NODES} is out of bounds for dimension 0 with size {NODES}"
    with pytest.raises(RuntimeError, match=message):
        selfs[2].index_add(0, index[2], sources[2])  # PyTorch's
    with pytest.raises(RuntimeError, match=message):
        add_rows(selfs[2], sources[2], index[2])
    with pytest.raises(RuntimeError, match=message):
        vmap(lambda s, j, x: add_rows(s, x, j))(selfs, index, sources)


def test_add_rows_in_place_is_index_add_() -> None:
    """add_rows_ (what the in-place entries call): PyTorch's index_add_ eagerly (a non-contiguous self through a
    copy), under vmap folded into a self batched in front and through add_rows and copy_ otherwise, with PyTorch's
    refusals."""
    add_rows_ = CPP_OPS.get().add_rows_
    selfs, index, sources = _add_rows_data()
    mine, theirs = selfs[0].clone(), selfs[0].clone()
    version = mine._version
    assert add_rows_(mine, sources[0], index[0]) is mine and mine._version > version
    torch.testing.assert_close(mine, theirs.index_add_(0, index[0], sources[0]))
    strided, expected = selfs[0].t().contiguous().t(), selfs[0].clone()
    add_rows_(strided, sources[0], index[0])
    torch.testing.assert_close(strided, expected.index_add_(0, index[0], sources[0]))
    want = torch.stack([s.clone().index_add_(0, j, x) for s, j, x in zip(selfs, index, sources, strict=True)])
    for name, self_layout in (("batch in front", selfs), ("batch behind", selfs.movedim(0, 1).contiguous())):
        batched_self = self_layout.clone()
        in_dims = (0 if name == "batch in front" else 1, 0, 0)
        vmap(lambda s, j, x: add_rows_(s, x, j), in_dims=in_dims)(batched_self, index, sources)
        torch.testing.assert_close(batched_self if in_dims[0] == 0 else batched_self.movedim(1, 0), want, msg=name)
    shared = selfs.clone()
    vmap(lambda s, x: add_rows_(s, x, index[0]))(shared, sources)
    torch.testing.assert_close(shared, torch.stack([s.clone().index_add_(0, index[0], x)
                                                    for s, x in zip(selfs, sources, strict=True)]))
    with pytest.raises(RuntimeError, match="vmap: .*is not possible because"):  # a per-sample write into one tensor
        vmap(lambda j, x: add_rows_(selfs[0].clone(), x, j))(index, sources)
    with pytest.raises(RuntimeError, match="unsupported operation"):  # index_add_'s overlap check
        add_rows_(sources[0][:NODES], sources[0][:EDGES], torch.arange(EDGES) % NODES)


def test_add_rows_in_place_records_as_pytorchs_in_place_ops() -> None:
    """Its node takes self's old history: gradients (and second ones) and forward-AD tangents equal index_add_'s;
    a leaf that requires grad is refused as PyTorch refuses it."""
    add_rows_ = CPP_OPS.get().add_rows_
    selfs, index, sources = _add_rows_data()
    self0, source0 = selfs[0].requires_grad_(), sources[0].requires_grad_()
    assert torch.autograd.gradcheck(lambda s, x: add_rows_(s * 2, x, index[0]), (self0, source0))
    assert torch.autograd.gradgradcheck(lambda s, x: add_rows_(s.sin(), x, index[0]).square(), (self0, source0))
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        add_rows_(self0, source0, index[0])
    s, x = selfs[0].detach(), sources[0].detach()
    tangents = (torch.randn_like(s), torch.randn_like(x))
    for pair in (tangents, (tangents[0], torch.zeros_like(x)), (torch.zeros_like(s), tangents[1])):
        _, got = torch.func.jvp(lambda a, b: add_rows_(a.clone(), b, index[0]), (s, x), pair)
        _, want = torch.func.jvp(lambda a, b: a.clone().index_add_(0, index[0], b), (s, x), pair)
        torch.testing.assert_close(got, want)
    _, got = torch.func.jvp(lambda b: add_rows_(s.clone(), b, index[0]), (x,), (tangents[1],))
    torch.testing.assert_close(got, torch.zeros_like(s).index_add(0, index[0], tangents[1]))


@pytest.mark.parametrize("in_place", (False, True), ids=("index_add", "index_add_"))
def test_an_empty_self_is_returned_as_pytorch_returns_it(in_place: bool) -> None:
    """PyTorch's index_add returns a self without elements as it is, whatever the index holds (it reads none of it);
    the entries hand such a call to it, so an index out of bounds or negative raises nothing there either."""
    ops = CPP_OPS.get()
    for self, index, source in ((torch.zeros(0, 3), torch.tensor([5]), torch.ones(1, 3)),
                                (torch.zeros(4, 0), torch.tensor([7, -9]), torch.zeros(2, 0))):
        if in_place:
            got = ops.index_add_.entry(self.clone(), 0, index, source)
            want = self.clone().index_add_(0, index, source)
        else:
            got, want = ops.index_add.entry(self, 0, index, source), self.index_add(0, index, source)
        assert got.shape == want.shape == self.shape
