"""The cpp_op kind (registry.core.kinds.CPP_OP) and its composites of masked_fill, masked_scatter and index_fill
(composites/cpp_ops.py): ops of our own in C++ with their forward, autograd, forward-AD and batching kernels, compared
with native PyTorch in a per-sample loop outside any transform under every stack their rule allows, bit for bit where
the mask is False, and refused by the rule where the C++ build is missing."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch import func

import registry
from registry.core import kernels, routing
from registry.core.context import Context
from registry.core.kernels.background import BUILD
from registry.core.kinds import KIND, KINDS
from registry.core.selector import SELECTOR, Selector, Verdict
from registry.harness.checks import PATTERNS, STACKS, check, skip_reason
from registry.harness.samples import SAMPLES

OPS = ("masked_fill", "masked_scatter", "index_fill")
FALLBACK = "There is a performance drop"


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The ops compile with the routing kernels; without a compiler the kind is invalid (tested below) and the rest
    of this module has nothing to run."""
    try:
        kernels.build_kernels(quiet=True)
    except kernels.KernelBuildError as error:
        if os.environ.get("ROUTING_TEST_REQUIRE_CPP"):
            raise
        pytest.skip(f"no C++ build here: {error}")


def test_cpp_op_is_one_entry_of_the_kind_table() -> None:
    assert "cpp_op" in KINDS and KIND["cpp_op"].rule is not None
    for op in OPS:
        assert registry.composites(op)["cpp_op"].kind == "cpp_op"
    assert kernels.fused_ops_available()


def test_the_rule_refuses_where_the_build_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = KIND["cpp_op"].rule
    assert rule(Context(stack=("vmap", "grad"))) is None
    monkeypatch.setattr(kernels, "fused_ops_available", lambda: False)
    problem = rule(Context(stack=("vmap", "grad")))
    assert problem is not None and problem.status == "error" and "not built" in problem.evidence
    assert rule(Context(stack=("compile", "vmap"))) is not None


def _cpp_verdict(selector: Selector) -> Verdict:
    decision = selector.select("masked_fill", stack="vmap(grad)", policy="rules")
    return next(v for v in decision.alternatives if v.composite == "cpp_op")


def test_a_build_that_lands_makes_cached_decisions_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decisions cached while the C++ ops were not there (the first use() started their build in the background)
    judged cpp_op invalid; once the build lands and use() switches to the C++ kernels, every selector's cache is
    cleared and the kind is valid again, with no clear_cache() by hand."""
    own = Selector(SELECTOR.table)  # another registry's selector is told too
    x, mask = torch.randn(3, 5), torch.rand(3, 5) > 0.5

    def pinned_call() -> torch.Tensor:
        with registry.use(pins={"masked_fill": "cpp_op"}):
            return func.vmap(lambda r, m: r.masked_fill(m, 1.5))(x, mask)

    routing.set_routing_backend("python")  # what use() runs on while the build is under way
    try:
        built = kernels.built
        monkeypatch.setattr(kernels, "_module", None)  # the extension not loaded yet in this process ...
        monkeypatch.setattr(kernels, "built", lambda: False)  # ... nor in the cache: the background build runs
        for selector in (SELECTOR, own):
            before = _cpp_verdict(selector)
            assert not before.ok and "not built" in before.reason
        with pytest.raises(registry.SelectionError, match="cpp_op"):
            pinned_call()
        monkeypatch.setattr(kernels, "built", built)  # the build lands in the cache
        monkeypatch.setattr(BUILD, "landed", True)
        monkeypatch.setattr(BUILD, "error", None)
        got = pinned_call()  # this use() entry switches to the C++ kernels, which load
        assert routing.routing_backend() == "cpp" and not BUILD.landed
        for selector in (SELECTOR, own):
            assert _cpp_verdict(selector).ok
        assert torch.equal(got, x.masked_fill(mask, 1.5))
    finally:
        routing.set_routing_backend("cpp")


CPP_STACKS = [s for s in STACKS if s != "compile"]  # the rule marks compile invalid


@pytest.mark.parametrize("stack", CPP_STACKS)
@pytest.mark.parametrize("op", OPS)
def test_cpp_op_under_every_stack(op: str, stack: str) -> None:
    """The C++ op, pinned, under every stack and batching pattern, against the Python loop of native PyTorch."""
    failures = []
    for sample in SAMPLES[op]:
        for pattern in PATTERNS:
            if skip_reason(sample, stack, pattern):
                continue
            with registry.use(pins={op: "cpp_op"}):
                outcome = check(sample, stack, pattern)
            if outcome.status != "ok":
                failures.append(f"{sample.id} {stack} {pattern}: {outcome.status} {outcome.detail}")
    assert failures == []


def _special(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    flat = values.view(-1)
    flat[0], flat[1], flat[2], flat[3] = float("nan"), float("inf"), float("-inf"), -0.0
    flat.view(torch.int32)[4] = flat.view(torch.int32)[0] | 1  # a NaN payload must survive bit for bit
    return values


def test_values_are_native_bit_for_bit_under_vmap() -> None:
    g = torch.Generator().manual_seed(3)
    x, source = _special((4, 3, 7), 1), _special((4, 21), 2)
    mask = torch.rand(4, 3, 7, generator=g) > 0.5
    value = torch.randn(4, generator=g)
    index = torch.tensor([0, 2, 2, -1])
    cases = {
        "masked_fill": (lambda x, m, v: x.masked_fill(m, v), (x, mask, value)),
        "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s), (x, mask, source)),
        "index_fill": (lambda x, v: x.index_fill(1, index, v), (x, value)),
    }
    for op, (f, args) in cases.items():
        want = torch.stack([f(*sample) for sample in zip(*args, strict=True)])
        with registry.use(pins={op: "cpp_op"}, record=True) as run, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = func.vmap(f)(*args)
        assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == [], op
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), op
        assert {d.composite for d in run.decisions} == {"cpp_op"}, op


def test_per_sample_gradients_without_a_fallback() -> None:
    """vmap(grad) through the C++ autograd and batching kernels: no per-sample loop, the loop's gradients."""
    g = torch.Generator().manual_seed(4)
    x, source = torch.randn(6, 40, generator=g, dtype=torch.float64), torch.randn(6, 40, generator=g,
                                                                                  dtype=torch.float64)
    mask = torch.rand(6, 40, generator=g) > 0.5

    def loss(x, s):
        return (x.masked_scatter(mask[0], s) ** 2).sum() + x.masked_fill(mask[1], 2.0).sum()

    def loop_grad(x, s):
        x, s = x.clone().requires_grad_(), s.clone().requires_grad_()
        return torch.autograd.grad(loss(x, s), (x, s))

    want = [torch.stack(parts) for parts in zip(*(loop_grad(a, b) for a, b in zip(x, source, strict=True)),
                                                strict=True)]
    with registry.use(pins={"masked_scatter": "cpp_op", "masked_fill": "cpp_op"}, record=True) as run, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = func.vmap(func.grad(loss, argnums=(0, 1)))(x, source)
    assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == []
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert {(d.op, d.composite) for d in run.decisions} == {("masked_scatter", "cpp_op"), ("masked_fill", "cpp_op")}


def test_too_short_a_source_raises_as_the_primitive_does() -> None:
    self, mask = torch.zeros(2, 4), torch.tensor([[True, True, True, False], [True, False, False, False]])
    with registry.use(pins={"masked_scatter": "cpp_op"}), \
            pytest.raises(RuntimeError, match="masked_scatter: .*more Trues than source has elements"):
        func.vmap(torch.Tensor.masked_scatter)(self, mask, torch.ones(2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.float16])
@pytest.mark.parametrize("cols", [3, 8, 37, 1000])
def test_scatter_and_its_gradients_at_every_row_length(dtype: torch.dtype, cols: int) -> None:
    """The row walks (8 or 4 elements a step where the CPU has AVX2, then one at a time) against native per sample,
    values and both gradients: rows shorter than a step, a source used up exactly, 1- to 8-byte elements."""
    g = torch.Generator().manual_seed(cols)
    mask = torch.rand(5, cols, generator=g) > 0.4
    x = (torch.randn(5, cols, generator=g) * 100).to(dtype)
    # As long as the densest row's Trues: that row's source is used up exactly, the others' are longer.
    source = (torch.randn(5, int(mask.sum(1).max()), generator=g) * 100).to(dtype)
    want = torch.stack([xs.masked_scatter(m, s) for xs, m, s in zip(x, mask, source, strict=True)])
    with registry.use(pins={"masked_scatter": "cpp_op"}):
        got = func.vmap(torch.Tensor.masked_scatter)(x, mask, source)
    assert torch.equal(got, want)
    if not dtype.is_floating_point:
        return

    def loss(xs, m, s):
        return (xs.masked_scatter(m, s) * torch.arange(cols, dtype=dtype)).sum()

    grads = [func.grad(loss, argnums=(0, 2))(xs, m, s) for xs, m, s in zip(x, mask, source, strict=True)]
    want_grads = [torch.stack(parts) for parts in zip(*grads, strict=True)]
    with registry.use(pins={"masked_scatter": "cpp_op"}):
        got_grads = func.vmap(func.grad(loss, argnums=(0, 2)))(x, mask, source)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)


def _empty_cases() -> list[tuple[str, Any, tuple[torch.Tensor, ...]]]:
    """Zero-size inputs: empty rows, rows of zero length, a mask with no True (an empty source), an empty index."""
    return [
        ("masked_fill", lambda x, m: x.masked_fill(m, 2.0), (torch.randn(3, 0), torch.zeros(3, 0, dtype=torch.bool))),
        ("masked_fill", lambda x, m: x.masked_fill(m, 2.0),
         (torch.randn(2, 0, 4), torch.ones(2, 0, 4, dtype=torch.bool))),
        ("masked_scatter", lambda x, m, s: x.masked_scatter(m, s),
         (torch.randn(3, 5), torch.zeros(3, 5, dtype=torch.bool), torch.randn(3, 0))),
        ("masked_scatter", lambda x, m, s: x.masked_scatter(m, s),
         (torch.randn(3, 0), torch.zeros(3, 0, dtype=torch.bool), torch.randn(3, 0))),
        ("index_fill", lambda x: x.index_fill(1, torch.tensor([], dtype=torch.long), 2.0), (torch.randn(3, 4, 2),)),
        ("index_fill", lambda x: x.index_fill(0, torch.tensor([1]), 2.0), (torch.randn(3, 2, 0),)),
    ]


@pytest.mark.parametrize("case", range(len(_empty_cases())))
def test_zero_size_inputs_equal_native(case: int) -> None:
    """Empty tensors straight into the C++ ops (no transform, vmap, and vmap(grad) of a sum through them): the
    values, shapes and gradients of native PyTorch in a loop over the batch."""
    op, f, args = _empty_cases()[case]
    float_args = tuple(a for a in args if a.is_floating_point())
    with registry.use(pins={op: "cpp_op"}, record=True) as run:
        plain = f(*args)
        batched = func.vmap(f)(*args)
        grads = func.vmap(func.grad(lambda *a: f(*a).sum()))(*args)
    assert torch.equal(plain, f(*args).clone()) and plain.shape == args[0].shape
    want = [f(*sample) for sample in zip(*args, strict=True)]  # every case has a batch of 3 or 2
    assert batched.shape == args[0].shape
    assert torch.equal(batched, torch.stack(want))

    def loop_grad(*sample: torch.Tensor) -> torch.Tensor:
        first = sample[0].clone().requires_grad_()
        return torch.autograd.grad(f(first, *sample[1:]).sum(), first, allow_unused=True)[0]

    assert grads.shape == float_args[0].shape
    assert torch.equal(grads, torch.stack([loop_grad(*sample) for sample in zip(*args, strict=True)]))
    assert {d.composite for d in run.decisions if d.op == op} == {"cpp_op"}


# --- the entry ops: masked_fill's and index_fill's composites called by the C++ routing without Python ----------

ENTRIES = ("masked_fill.Scalar", "masked_fill.Tensor", "index_fill.int_Scalar", "index_fill.int_Tensor",
           "masked_scatter.entry")


def _filled(entry: str) -> Any:
    """One sample's loss through ``entry``'s aten overload: x (3, 8) filled with v (a 0-d tensor) or 2.5, or
    scattered into from x's reverse times v where a mask (broadcast to x) is True; squared."""
    op, _, overload = entry.partition(".")
    mask = torch.tensor([True, False, True, True, False, False, True, False])
    index = torch.tensor([0, 5, 7])  # not -1: PyTorch's own backward of index_fill's value rejects it (the loop's)

    def loss(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        value = v if overload.endswith("Tensor") else 2.5
        if op == "masked_scatter":
            filled = x.masked_scatter(mask, x.flip(0) * v)
        else:
            filled = x.masked_fill(mask, value) if op == "masked_fill" else x.index_fill(1, index, value)
        return (filled ** 2 * v).sum()

    return loss


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_routed_call_runs_the_entry_op_without_python(entry: str, python_calls: Any) -> None:
    """The fused primitives' composites are their entry ops (register(..., redirect=)): under vmap(grad) the C++
    routing calls the entry of the call's own overload, the composite's Python function never runs, and the
    per-sample gradients equal the loop's."""
    import composites.cpp_ops

    calls = python_calls(composites.cpp_ops.OPS)
    loss, op = _filled(entry), entry.partition(".")[0]
    g = torch.Generator().manual_seed(6)
    x, v = torch.randn(5, 3, 8, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    step = func.vmap(func.grad(loss, argnums=(0, 1)))
    with registry.use(pins={op: "cpp_op"}, record=True) as run:
        step(x, v)
    assert {(d.op, d.composite) for d in run.decisions} == {(op, "cpp_op")}
    calls.clear()
    with registry.use(pins={op: "cpp_op"}), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = step(x, v)
    assert f"multicomposite::{op}" in {event.key for event in profile.key_averages()}
    assert calls == []
    for i in range(x.shape[0]):
        leaves = (x[i].clone().requires_grad_(), v[i].clone().requires_grad_())
        want = torch.autograd.grad(loss(*leaves), leaves)
        torch.testing.assert_close(got[0][i], want[0])
        torch.testing.assert_close(got[1][i], want[1])


_REJECTED = {  # what PyTorch rejects, one sample (3, 8) and its batch of 4: the op, and the call
    "uint8 mask": ("masked_fill", lambda x: x.masked_fill(torch.ones(3, 8, dtype=torch.uint8), 1.0)),
    "1-d value": ("masked_fill", lambda x: x.masked_fill(torch.ones(3, 8, dtype=torch.bool), torch.ones(2))),
    "mask does not broadcast": ("masked_fill", lambda x: x.masked_fill(torch.ones(4, dtype=torch.bool), 1.0)),
    "complex scalar": ("masked_fill", lambda x: x.masked_fill(torch.ones(3, 8, dtype=torch.bool), 1 + 2j)),
    "int32 index": ("index_fill", lambda x: x.index_fill(1, torch.tensor([0, 1], dtype=torch.int32), 1.0)),
    "dim out of range": ("index_fill", lambda x: x.index_fill(5, torch.tensor([0]), 1.0)),
    "2-d index": ("index_fill", lambda x: x.index_fill(1, torch.zeros(2, 2, dtype=torch.long), 1.0)),
    "complex value tensor": ("index_fill", lambda x: x.index_fill(1, torch.tensor([0]), torch.tensor(1 + 1j))),
    "source of another dtype": ("masked_scatter",
                                lambda x: x.masked_scatter(torch.ones(3, 8, dtype=torch.bool), x.double())),
    "uint8 mask to scatter": ("masked_scatter", lambda x: x.masked_scatter(torch.ones(3, 8, dtype=torch.uint8), x)),
    "scatter mask does not broadcast": ("masked_scatter",
                                        lambda x: x.masked_scatter(torch.ones(5, dtype=torch.bool), x)),
}


def _error(f: Any, *args: Any) -> tuple[type, str]:
    with pytest.raises((RuntimeError, IndexError, ValueError)) as caught:
        f(*args)
    return type(caught.value), str(caught.value).splitlines()[0]


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("case", list(_REJECTED))
def test_arguments_pytorch_rejects_raise_its_own_error(case: str) -> None:
    """The entry ops pass what PyTorch rejects to PyTorch's own op: under vmap the routed call raises native vmap's
    error, type and message, and eagerly the composite raises native's."""
    op, f = _REJECTED[case]
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # native's per-sample loop
        want_batched = _error(func.vmap(f), x)
        with registry.use(pins={op: "cpp_op"}):
            assert _error(func.vmap(f), x) == want_batched
    want = _error(f, x[0])
    with registry.use(pins={op: "cpp_op"}):
        assert _error(f, x[0]) == want


def test_a_complex_value_without_an_imaginary_part_fills_as_native() -> None:
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(8))
    mask = torch.rand(3, 8, generator=torch.Generator().manual_seed(9)) > 0.5
    value = torch.tensor(2 + 0j)
    want = torch.stack([sample.masked_fill(mask, value) for sample in x])
    with registry.use(pins={"masked_fill": "cpp_op"}), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(func.vmap(lambda s: s.masked_fill(mask, value))(x), want)
