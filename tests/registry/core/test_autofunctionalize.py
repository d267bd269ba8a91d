"""In-place writes of batched values into fresh, unbatched buffers: functionalized automatically inside use().

Each function below writes per-sample values into a buffer it has just made, the way model code does. vmap refuses
every one of them outside use(); inside use() each runs and equals a per-sample loop of torch.autograd outside any
transform, under vmap, vmap(grad), vmap(jacrev), vmap(jacfwd) and vmap(hessian), and jacrev, jacfwd and hessian of
one sample.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import func

import registry
from registry.core import functionalization, routing
from registry.core.functionalization import FUNCTIONALIZED, INPLACE_REFUSAL, OutsideWriteError, function_key

FALLBACK = "There is a performance drop"
WEIGHT = torch.tensor([0.5, -1.5, 2.0])
INDEX = torch.tensor([0, 2, 0])  # repeated: index_add_ and scatter_add_ sum into row 0
UNIQUE_INDEX = torch.tensor([3, 0, 2])  # index_put_ without accumulate: a repeated index has no defined winner
MASK = torch.tensor([True, False, True])


def empty_like_copy(x: torch.Tensor) -> torch.Tensor:
    """The seed: a buffer shaped like a tensor from outside (a weight), then copy_ of a per-sample value."""
    buffer = torch.empty_like(WEIGHT)
    buffer.copy_(x * WEIGHT)
    return buffer.sin().sum()


def new_zeros_scatter_add(x: torch.Tensor) -> torch.Tensor:
    """A graph library's scatter, ``src.new_zeros(size).scatter_add_(0, index, src)``, over a per-sample graph: the
    messages are shared, the index (which node each goes to) differs per sample."""
    src = WEIGHT.unsqueeze(1) * torch.arange(1.0, 5.0)
    index = x.argsort().unsqueeze(1).expand(3, 4)
    out = src.new_zeros(5, 4).scatter_add_(0, index, src)
    return (out[:3].sum(1) * x).sin().sum()


def index_add(x: torch.Tensor) -> torch.Tensor:
    """``out.index_add_(0, index, msg)`` into zeros made from an outside tensor."""
    return WEIGHT.new_zeros(5).index_add_(0, INDEX, x * WEIGHT).sin().sum()


def index_put(x: torch.Tensor) -> torch.Tensor:
    """``buf[idx] = v`` (index_put_)."""
    buffer = torch.zeros(5)
    buffer[UNIQUE_INDEX] = x.exp()
    return buffer.sin().sum()


def index_put_into_clone(x: torch.Tensor) -> torch.Tensor:
    """``h = h0.clone(); h[idx] = v``: the buffer is a copy of an outside tensor."""
    buffer = WEIGHT.clone()
    buffer[UNIQUE_INDEX[1:]] = x[:2] * 2
    return (buffer * x).sin().sum()


def masked_fill(x: torch.Tensor) -> torch.Tensor:
    """``buf.masked_fill_(mask, v)`` with a per-sample value."""
    buffer = torch.ones(3)
    buffer.masked_fill_(MASK, x.sum())
    return (buffer * x).sin().sum()


def masked_fill_batched_mask(x: torch.Tensor) -> torch.Tensor:
    """``buf.masked_fill_(mask, v)`` with a per-sample mask."""
    buffer = torch.ones(3)
    buffer.masked_fill_(x > 0, 0.25)
    return (buffer * x).sin().sum()


FUNCTIONS = [empty_like_copy, new_zeros_scatter_add, index_add, index_put, index_put_into_clone, masked_fill,
             masked_fill_batched_mask]


def _per_sample(transform: str, f: Callable[[torch.Tensor], torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
    """The reference: one sample, torch.autograd, no torch.func transform."""
    if transform == "vmap":
        return f(sample)
    if transform == "vmap(grad)":
        sample = sample.clone().requires_grad_()
        return torch.autograd.grad(f(sample), sample)[0]
    if transform in ("vmap(jacrev)", "vmap(jacfwd)"):
        return torch.autograd.functional.jacobian(f, sample)
    return torch.autograd.functional.hessian(f, sample)


TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]] = {
    "vmap": func.vmap,
    "vmap(grad)": lambda f: func.vmap(func.grad(f)),
    "vmap(jacrev)": lambda f: func.vmap(func.jacrev(f)),
    "vmap(jacfwd)": lambda f: func.vmap(func.jacfwd(f)),
    "vmap(hessian)": lambda f: func.vmap(func.hessian(f)),
}

X = torch.tensor([[0.3, -1.2, 0.8], [1.1, 0.4, -0.6], [-0.9, 0.2, 1.7], [0.05, -0.3, -1.4]])


@pytest.fixture(autouse=True)
def _forget_functionalized() -> Iterator[None]:
    """Each test starts with no function remembered as needing functionalization."""
    FUNCTIONALIZED.clear()
    yield
    FUNCTIONALIZED.clear()


@pytest.mark.parametrize("f", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_pytorch_refuses_outside_use(f: Callable[[torch.Tensor], torch.Tensor]) -> None:
    with pytest.raises(RuntimeError, match="is not possible because there exists a Tensor `other` in extra_args"):
        func.vmap(f)(X)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("f", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_inside_use_equals_the_per_sample_loop(f: Callable[[torch.Tensor], torch.Tensor], transform: str,
                                               fallback_warnings: list[warnings.WarningMessage]) -> None:
    expected = torch.stack([_per_sample(transform, f, sample) for sample in X])
    with registry.use():
        first = TRANSFORMS[transform](f)(X)  # refused, then run functionalized
        again = TRANSFORMS[transform](f)(X)  # remembered: functionalized from the start
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(again, expected)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize("f", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_one_sample_jacobians_inside_use_equal_autograd(f: Callable[[torch.Tensor], torch.Tensor],
                                                        transform: str) -> None:
    """jacrev, jacfwd and hessian of one sample (their own vmap over the basis) inside use()."""
    reference = torch.autograd.functional.hessian if transform == "hessian" else torch.autograd.functional.jacobian
    with registry.use():
        got = getattr(func, transform)(f)(X[0])
    torch.testing.assert_close(got, reference(f, X[0]))


def test_a_remembered_function_runs_functionalized_from_the_start() -> None:
    runs: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return index_add(x)

    with registry.use():
        func.vmap(counted)(X)
        assert len(runs) == 2  # the refused run, then the functionalized one
        assert function_key(counted) in FUNCTIONALIZED
        func.vmap(counted)(X)
        assert len(runs) == 3


def test_grad_of_different_functions_is_remembered_apart() -> None:
    """grad(f) is a torch.func closure shared by every f: what it wraps tells them apart."""
    assert function_key(func.grad(index_add)) != function_key(func.grad(index_put))
    assert function_key(func.grad(index_add)) == function_key(func.grad(index_add))
    with registry.use():
        func.vmap(func.grad(index_add))(X)
    assert function_key(func.grad(index_add)) in FUNCTIONALIZED
    assert function_key(func.grad(index_put)) not in FUNCTIONALIZED


def test_the_retry_starts_from_the_same_random_state() -> None:
    """A function that draws random numbers before the refused write: the retry sees the same numbers, so the result
    equals a run functionalized from the start, and the generator ends where that run leaves it."""

    def noisy(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(3)
        return torch.zeros(5).index_add_(0, INDEX, x + noise)

    torch.manual_seed(7)
    expected = func.vmap(func.functionalize(noisy), randomness="different")(X)
    expected_state = torch.get_rng_state()
    torch.manual_seed(7)
    with registry.use():
        got = func.vmap(noisy, randomness="different")(X)
    torch.testing.assert_close(got, expected)
    assert torch.equal(torch.get_rng_state(), expected_state)


def test_captured_vmap_and_the_transforms_reach_it() -> None:
    """``from torch.func import vmap`` captured before use(), and torch.vmap: the same implementation underneath."""
    captured = func.vmap
    with registry.use():
        torch.testing.assert_close(captured(index_add)(X), torch.stack([index_add(s) for s in X]))
        torch.testing.assert_close(torch.vmap(index_put)(X), torch.stack([index_put(s) for s in X]))


def test_policy_native_does_not_functionalize() -> None:
    with registry.use(policy="native"), pytest.raises(RuntimeError, match="index_add_"):
        func.vmap(index_add)(X)


def test_unrelated_errors_pass_through_unchanged() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(4)

    with pytest.raises(RuntimeError) as native:
        func.vmap(broken)(X)
    with registry.use(), pytest.raises(RuntimeError) as routed:
        func.vmap(broken)(X)
    assert str(routed.value) == str(native.value)
    assert not isinstance(routed.value, OutsideWriteError)


def test_nothing_changes_outside_use() -> None:
    """The vmap implementation is PyTorch's for a thread outside use(): the refusal is PyTorch's own error."""
    with registry.use():
        func.vmap(index_add)(X)
    assert function_key(index_add) in FUNCTIONALIZED
    with pytest.raises(RuntimeError) as raised:
        func.vmap(index_add)(X)
    assert not isinstance(raised.value, OutsideWriteError)
    assert str(raised.value).startswith("vmap: index_add_(self, *extra_args) is not possible")


# --- writes that cannot work: per-sample values into a tensor that lives outside the transform ---------------------

TOTALS = torch.zeros(5)


def test_write_into_a_global_names_it() -> None:
    def accumulate(x: torch.Tensor) -> torch.Tensor:
        TOTALS.index_add_(0, INDEX, x)
        return x.sum()

    with registry.use(), pytest.raises(OutsideWriteError) as raised:
        func.vmap(accumulate)(X)
    text = str(raised.value)
    assert text.startswith(f"vmap: an in-place write at {__file__}:")
    assert "(`TOTALS.index_add_(0, INDEX, x)`) puts per-sample values into `TOTALS` (a global, shape [5], float32)" \
        in text
    assert "it lives outside the transformed function" in text
    assert "buf = buf.index_add(0, idx, v)" in text
    assert INPLACE_REFUSAL in text  # an enclosing vmap still recognizes the refusal
    assert torch.equal(TOTALS, torch.zeros(5))


def test_write_into_a_closure_under_grad_names_it() -> None:
    shared = torch.zeros(3)

    def accumulate(x: torch.Tensor) -> torch.Tensor:
        shared.copy_(x)
        return (x * 2).sum()

    with registry.use(), pytest.raises(OutsideWriteError) as raised:
        func.vmap(func.grad(accumulate))(X)
    assert "puts per-sample values into `shared` (a closure variable, shape [3], float32)" in str(raised.value)


class _Running(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return x * self.weight


def test_write_into_a_module_buffer_names_it() -> None:
    model = _Running()
    with registry.use(), pytest.raises(OutsideWriteError) as raised:
        func.vmap(model)(X)
    assert "puts per-sample values into `self.total` (a buffer of _Running, shape [3], float32)" in str(raised.value)


def test_write_into_a_parameter_names_it() -> None:
    model = _Running()

    def step(x: torch.Tensor) -> torch.Tensor:
        model.weight.data.mul_(x)
        return x.sum()

    with registry.use(), pytest.raises(OutsideWriteError) as raised:
        func.vmap(step)(X)
    assert "into `model.weight.data` (an attribute of Parameter, shape [3], float32)" in str(raised.value)


def test_functionalization_module_patches_one_function() -> None:
    registry.use()  # registers the kernels and installs the vmap implementation
    import torch._functorch.vmap as functorch_vmap  # noqa: PLC2701 - functorch's internals have no public API

    assert functorch_vmap._flat_vmap == functionalization.PATCH.flat_vmap  # the default patch's, bound


def test_one_wrapper_around_several_ops_is_remembered_per_op() -> None:
    # A wrapper called with a builtin that writes into a fresh buffer is remembered; the same wrapper around
    # another builtin is another function (the survey and the harness wrap every op alike).
    def wrapping(op):
        return lambda *args: op(*args)

    assert function_key(wrapping(torch.special.log_ndtr)) != function_key(wrapping(torch.special.airy_ai))
    assert function_key(wrapping(torch.ops.aten.sin.default)) != function_key(wrapping(torch.ops.aten.cos.default))
    assert function_key(wrapping(torch.Tensor.zero_)) != function_key(wrapping(torch.Tensor.index_add_))
    assert function_key(wrapping(torch.sin)) == function_key(wrapping(torch.sin))


def test_a_functionalized_function_reaching_an_op_only_a_primitive_batches_runs_native() -> None:
    # ldl_solve batches through its primitive, which functionalize cannot run; functionalized for its write into a
    # fresh buffer, the function still runs (PyTorch's own ldl_solve in vmap's loop) and equals the loop.
    a = torch.randn(4, 3, 3)
    ld, pivots = torch.linalg.ldl_factor(a @ a.mT + 3 * torch.eye(3))
    b = torch.randn(4, 3, 2)

    def solve(ld: torch.Tensor, pivots: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros(3, 2).index_add_(0, torch.arange(3), b)
        return torch.linalg.ldl_solve(ld, pivots, buffer)

    expected = torch.stack([solve(ld[i], pivots[i], b[i]) for i in range(4)])
    with warnings.catch_warnings(), registry.use():
        warnings.simplefilter("ignore")  # the loop's fallback warning: native runs there
        for _ in range(2):  # detected, then remembered
            torch.testing.assert_close(func.vmap(solve)(ld, pivots, b), expected)


# --- writes through views and out= arguments (what functionalization turns into select/slice/diagonal/as_strided
# scatters, and out= computed out of place then copied) -------------------------------------------------------------


def trajectory(x: torch.Tensor) -> torch.Tensor:
    """An ODE solver's preallocated trajectory: ``solution = torch.empty(T, *y0.shape); solution[0] = y0``, then a
    step per row (integer-index writes: select, then copy_)."""
    solution = torch.empty(3, 3)
    solution[0] = x
    for step in range(1, 3):
        solution[step] = solution[step - 1] * WEIGHT + x.sin()
    return (solution * solution).sum()


def slice_open_end(x: torch.Tensor) -> torch.Tensor:
    """``out[:, 1:] = v``: functionalization records the open end as 2**63 - 1."""
    out = torch.zeros(2, 4)
    out[:, 1:] = x * WEIGHT
    return out.sin().sum() + out[:, 0].sum()


def slice_step(x: torch.Tensor) -> torch.Tensor:
    """``out[::2] = v``: an open end and a step."""
    out = torch.ones(6)
    out[::2] = x.exp()
    return (out * torch.arange(6.0)).sin().sum()


def slice_ellipsis(x: torch.Tensor) -> torch.Tensor:
    """``out[..., :-1] = v``."""
    out = torch.zeros(2, 4)
    out[..., :-1] = x * x
    return (out.cos() * torch.arange(8.0).reshape(2, 4)).sum()


def select_copy(x: torch.Tensor) -> torch.Tensor:
    """``out[1].copy_(v)``."""
    out = torch.zeros(3, 3)
    out[1].copy_(x)
    return (out.sin() * torch.arange(9.0).reshape(3, 3)).sum()


def narrow_copy(x: torch.Tensor) -> torch.Tensor:
    """``out.narrow(0, 1, 2).copy_(v)`` into zeros made from an outside tensor."""
    out = WEIGHT.new_zeros(4, 3)
    out.narrow(0, 1, 2).copy_(torch.stack([x, 2 * x]))
    return (out.sin() * torch.arange(12.0).reshape(4, 3)).sum()


def diagonal_copy(x: torch.Tensor) -> torch.Tensor:
    """``out.diagonal().copy_(v)``."""
    out = torch.ones(3, 3)
    out.diagonal().copy_(x * WEIGHT)
    return (out @ x).sin().sum()


def unfold_copy(x: torch.Tensor) -> torch.Tensor:
    """``out.unfold(0, 2, 2).copy_(v)``: windows of a flat buffer."""
    out = torch.zeros(6)
    out.unfold(0, 2, 2).copy_(torch.stack([x[:2], x[1:], x[::2]]))
    return (out.sin() * torch.arange(6.0)).sum()


def as_strided_copy(x: torch.Tensor) -> torch.Tensor:
    """``out.as_strided(size, stride, offset).copy_(v)``."""
    out = torch.zeros(8)
    out.as_strided((2, 3), (4, 1), 1).copy_(torch.stack([x, x * x]))
    return (out.sin() * torch.arange(8.0)).sum()


def select_add(x: torch.Tensor) -> torch.Tensor:
    """``out.select(1, 0).add_(v)``: in-place arithmetic through a view."""
    out = torch.ones(3, 4)
    out.select(1, 0).add_(x)
    return (out.sin() * torch.arange(12.0).reshape(3, 4)).sum()


def empty_like_slices(x: torch.Tensor) -> torch.Tensor:
    """``out = torch.empty_like(weight); out[:] = 0; out[1:] = v``."""
    out = torch.empty_like(WEIGHT)
    out[:] = 0
    out[1:] = x[:2] * x[1:]
    return out.exp().sum()


def mul_out(x: torch.Tensor) -> torch.Tensor:
    """``torch.mul(a, b, out=buf)``."""
    buffer = torch.empty(3)
    torch.mul(x, WEIGHT, out=buffer)
    return buffer.sin().sum()


def add_out_resized(x: torch.Tensor) -> torch.Tensor:
    """``torch.add(a, b, alpha=2, out=buf)`` into an empty buffer, which out= resizes."""
    buffer = torch.empty(0)
    torch.add(x, WEIGHT, alpha=2, out=buffer)
    return (buffer * x).sin().sum()


def matmul_out(x: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(m, v, out=buf)`` (a composite op whose out= form decomposes into mv.out)."""
    buffer = WEIGHT.new_empty(3)
    torch.matmul(torch.eye(3) + x[:, None] * WEIGHT, x, out=buffer)
    return buffer.sin().sum()


# Native autograd refuses out= with a tensor that requires grad, outside any transform too: the loop of those three
# runs their out-of-place form.
OUT_OF_PLACE: dict[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] = {
    mul_out: lambda x: torch.mul(x, WEIGHT).sin().sum(),
    add_out_resized: lambda x: (torch.add(x, WEIGHT, alpha=2) * x).sin().sum(),
    matmul_out: lambda x: torch.matmul(torch.eye(3) + x[:, None] * WEIGHT, x).sin().sum(),
}
WRITES = [trajectory, slice_open_end, slice_step, slice_ellipsis, select_copy, narrow_copy, diagonal_copy,
          unfold_copy, as_strided_copy, select_add, empty_like_slices, mul_out, add_out_resized, matmul_out]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("f", WRITES, ids=[f.__name__ for f in WRITES])
def test_writes_through_views_and_out_equal_the_per_sample_loop(
        f: Callable[[torch.Tensor], torch.Tensor], transform: str,
        fallback_warnings: list[warnings.WarningMessage]) -> None:
    expected = torch.stack([_per_sample(transform, OUT_OF_PLACE.get(f, f), sample) for sample in X])
    with registry.use(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
        first = TRANSFORMS[transform](f)(X)
        again = TRANSFORMS[transform](f)(X)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(again, expected)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize("f", WRITES, ids=[f.__name__ for f in WRITES])
def test_writes_through_views_and_out_one_sample_jacobians(f: Callable[[torch.Tensor], torch.Tensor],
                                                            transform: str) -> None:
    reference = torch.autograd.functional.hessian if transform == "hessian" else torch.autograd.functional.jacobian
    with registry.use():
        got = getattr(func, transform)(f)(X[0])
    torch.testing.assert_close(got, reference(OUT_OF_PLACE.get(f, f), X[0]))


@pytest.mark.parametrize(("f", "error"), [
    (slice_open_end, INPLACE_REFUSAL),
    (as_strided_copy, INPLACE_REFUSAL),
    (mul_out, "mul(): functions with out=... arguments don't support automatic differentiation"),
])
def test_writes_outside_use_fail_as_before(f: Callable[[torch.Tensor], torch.Tensor], error: str) -> None:
    """Outside use() vmap refuses the write (it is never functionalized there), and out= its own way."""
    with pytest.raises(RuntimeError, match=re.escape(error)):
        func.vmap(func.grad(f))(X)


SHARED = torch.zeros(4, 3)


def test_a_slice_write_into_a_global_names_it() -> None:
    def write(x: torch.Tensor) -> torch.Tensor:
        SHARED[1:] = x
        return x.sum()

    with registry.use(), pytest.raises(OutsideWriteError) as raised:
        func.vmap(write)(X)
    assert "(`SHARED[1:] = x`) puts per-sample values into `SHARED` (a global, shape [4, 3], float32)" in \
        str(raised.value)
    assert torch.equal(SHARED, torch.zeros(4, 3))


def test_an_out_argument_from_outside_names_it() -> None:
    totals = torch.zeros(3)

    def write(x: torch.Tensor) -> torch.Tensor:
        torch.mul(x, WEIGHT, out=totals)
        return x.sum()

    with registry.use(), pytest.raises(OutsideWriteError) as raised:
        func.vmap(write)(X)
    assert ("(`torch.mul(x, WEIGHT, out=totals)`) puts per-sample values into `totals` (a closure variable, "
            "shape [3], float32)") in str(raised.value)
    assert torch.equal(totals, torch.zeros(3))


def test_an_out_argument_keeps_out_semantics() -> None:
    """The result is out itself; a result that cannot be cast to out's dtype is refused as PyTorch refuses it."""
    def into(x: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(3)
        result = torch.mul(x, 2, out=buffer)
        assert result is buffer
        return result

    with registry.use():
        torch.testing.assert_close(func.vmap(into)(X), X * 2)
        with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
            func.vmap(lambda x: torch.mul(x, 2, out=torch.empty(3, dtype=torch.long)))(X)


# --- out[idx] += v with repeated indices (Why 5(a) of issue 25) ----------------------------------------------------

REPEATED = torch.tensor([0, 2, 0, 1, 2, 0])
MESSAGES = torch.tensor([0.5, -1.5, 2.0, 1.0, 0.25, -0.75])


def repeated_augmented_write(x: torch.Tensor) -> torch.Tensor:
    """``out[idx] += v`` with repeated indices: Python's ``out[idx] = out[idx] + v``, an index_put without
    accumulate (one of the repeated positions' values lands; PyTorch leaves which unspecified)."""
    out = torch.zeros(3)
    out[REPEATED] += MESSAGES * x.repeat(2)
    return (out.sin() * torch.tensor([1.0, 2.0, 3.0])).sum()


def test_repeated_augmented_write_native_forward_and_reverse_mode_disagree() -> None:
    """The bug itself, natively and outside any vmap: jacfwd gives only the landing position's values a derivative,
    jacrev (and torch.autograd) gives every repeated position's values the gradient."""
    if not torch.__version__.startswith("2.13"):
        pytest.skip("measured on PyTorch 2.13")
    forward, reverse = func.jacfwd(repeated_augmented_write)(X[0]), func.jacrev(repeated_augmented_write)(X[0])
    assert not torch.allclose(forward, reverse)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_repeated_augmented_write_inside_use_equals_the_per_sample_loop(
        transform: str, fallback_warnings: list[warnings.WarningMessage]) -> None:
    expected = torch.stack([_per_sample(transform, repeated_augmented_write, sample) for sample in X])
    with registry.use():
        got = TRANSFORMS[transform](repeated_augmented_write)(X)
    torch.testing.assert_close(got, expected)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_repeated_augmented_write_one_sample_jacobians_inside_use(transform: str) -> None:
    reference = torch.autograd.functional.hessian if transform == "hessian" else torch.autograd.functional.jacobian
    with registry.use():
        got = getattr(func, transform)(repeated_augmented_write)(X[0])
    torch.testing.assert_close(got, reference(repeated_augmented_write, X[0]))


def test_repeated_writes_with_infinite_values_keep_their_value() -> None:
    """Where the written values are not finite the derivative's zero would be nan (inf - inf): it is left out."""
    def write(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(3)
        out[REPEATED[:3]] = torch.stack([x[0], torch.tensor(float("inf")), x[1]])
        return out

    expected = torch.stack([write(sample) for sample in X])
    with registry.use():
        got = func.vmap(lambda x: func.jvp(write, (x,), (torch.ones(3),))[0])(X)
    torch.testing.assert_close(got, expected)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIRST_OUT_CALL = """
import sys
import torch
import torch._functorch.eager_transforms as eager_transforms
from torch import func
import registry
from registry.core import out_arguments, transform_calls

PYTORCH_GRAD = eager_transforms.grad_and_value_impl
LEAN_GRAD = transform_calls.PATCH.grad_and_value_impl
weight = torch.tensor([0.5, -1.5, 2.0])

def f(x):
    buffer = torch.empty(3)
    torch.mul(x, weight, out=buffer)
    return (buffer * torch.rand(3)).sum()

transforms = {
    "grad": func.grad(f),
    "vmap": func.vmap(f, randomness="same"),
    "jvp": lambda x: func.jvp(f, (x,), (torch.ones(3),))[1],
}
with registry.use():
    func.vmap(func.grad(lambda x: (x * weight).sum()))(torch.ones(2, 3))
    # grad's implementation without the out= retry: PyTorch's, or transform_calls' lean one in its place
    print(out_arguments.registered(), eager_transforms.grad_and_value_impl in (PYTORCH_GRAD, LEAN_GRAD))
    torch.manual_seed(0)
    got = transforms[sys.argv[1]](torch.ones(2, 3) if sys.argv[1] == "vmap" else torch.ones(3))
    print(out_arguments.registered())
torch.manual_seed(0)
draws = torch.rand(3)
expected = {"grad": weight * draws, "vmap": (weight * draws).sum().expand(2), "jvp": (weight * draws).sum()}
print(torch.equal(got, expected[sys.argv[1]]))
"""


@pytest.mark.parametrize(("backend", "transform", "before_first_out_call"), [
    ("cpp", "grad", ["True", "True"]),
    ("python", "grad", ["False", "False"]),
    ("python", "vmap", ["False", "False"]),  # vmap's retry is functionalization's; jvp's and vjp's are grad's
])
def test_out_kernels_are_registered_at_install_or_at_the_first_refused_out_call(
        backend: str, transform: str, before_first_out_call: list[str], request: pytest.FixtureRequest) -> None:
    """The C++ backend registers the out= kernels with its routing kernels, and grad's implementation is PyTorch's
    own (no retry wrapper); with the Python ones a process whose transforms pass no out= never registers them, and
    the first refused out= call (under grad or vmap) registers them and runs again from the same random state.
    Either way the draws equal those made outside."""
    if backend == "cpp":
        request.getfixturevalue("compiled_kernels")  # built (or skipped, or failed) here, not in the subprocess
    done = subprocess.run([sys.executable, "-c", FIRST_OUT_CALL, transform], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT, routing.BACKEND_ENV: backend})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [*before_first_out_call, "True", "True"]
