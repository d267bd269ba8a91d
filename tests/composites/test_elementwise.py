"""Behaviour of the elementwise and statistics composites that the generic coverage test cannot see: type promotion
of batched 0-d arguments, jacfwd of entr below zero, batched test sets of isin, per-sample ranges of histc, error
texts, non-differentiable outputs, and native kept where native is right."""

from __future__ import annotations

import re

import pytest
import torch
from torch import func

import registry
from composites.elementwise import POLYNOMIALS


def _fallbacks(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "There is a performance drop" in str(w.message)]


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials_batch_without_fallback(name: str, fallback_warnings: list) -> None:
    """Over 64 samples the primitive runs (faster than vmap's loop in the shipped costs), with no fallback."""
    op = getattr(torch.special, name)
    x = torch.linspace(-0.9, 0.9, 256, dtype=torch.float64).reshape(64, 4)
    n = torch.tensor([[0.0, 1.0, 2.0, 5.0]], dtype=torch.float64)
    with registry.use():
        batched = func.vmap(op, in_dims=(0, None))(x, n)
        both = func.vmap(op, in_dims=(0, 1))(x, n.T.expand(4, 64))
    assert _fallbacks(fallback_warnings) == []
    assert torch.equal(batched, torch.stack([op(row, n) for row in x]))
    assert torch.equal(both, torch.stack([op(x[b], n.T.expand(4, 64)[:, b]) for b in range(64)]))


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials_over_a_few_small_samples_keep_vmaps_loop(name: str) -> None:
    """Over 3 samples of 4 elements vmap's loop over PyTorch's kernel is faster than the primitive in the shipped
    costs (measured on OpInfo's samples): it runs, by cost, and equals the loop."""
    op = getattr(torch.special, name)
    x = torch.linspace(-0.9, 0.9, 12, dtype=torch.float64).reshape(3, 4)
    n = torch.tensor([[0.0, 1.0, 2.0, 5.0]], dtype=torch.float64)
    with registry.use(record=True) as block:
        got = func.vmap(op, in_dims=(0, None))(x, n)
    [decision] = [d for d in block.decisions if d.op == f"special_{name}"]
    assert (decision.composite, decision.native_loops) == ("native", True)
    assert "slower than native at this size" in decision.reason
    assert torch.equal(got, torch.stack([op(row, n) for row in x]))


def test_batched_zero_dim_argument_promotes_as_a_zero_dim_tensor() -> None:
    # float32 x with a 0-d float64 n: float32 natively. Batched, n is dimensioned physically and would promote to
    # float64 if the op were called on the physical tensors as they are.
    x = torch.rand(5)
    n = torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64)
    with registry.use():
        out = func.vmap(torch.special.chebyshev_polynomial_t, in_dims=(None, 0))(x, n)
    expected = torch.stack([torch.special.chebyshev_polynomial_t(x, n_b) for n_b in n])
    assert expected.dtype == torch.float32
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_polynomial_outputs_do_not_require_grad_as_natively() -> None:
    x = torch.rand(4, 3, requires_grad=True)
    with registry.use():
        out = func.vmap(torch.special.hermite_polynomial_h, in_dims=(0, None))(x, 3)
    assert not out.requires_grad
    assert not torch.special.hermite_polynomial_h(x, 3).requires_grad


def test_entr_jacfwd_is_diagonal_below_zero() -> None:
    # Native jacfwd spreads the nan (x < 0) and inf (x = 0) of -(1 + log x) along the rows of the Jacobian through
    # one-hot tangents (0 * nan); inside use() a zero tangent gives a zero, so the Jacobian is diagonal, and u^T J is
    # the vjp with u, as the survey checks it.
    x = torch.tensor([-0.5, 0.0, 0.5, 2.0], dtype=torch.float64)
    native_forward = func.jacfwd(torch.special.entr)(x)
    with registry.use():
        forward = func.jacfwd(torch.special.entr)(x)
    off_diagonal = ~torch.eye(4, dtype=torch.bool)
    assert native_forward[:2][off_diagonal[:2]].isnan().all()  # the defect
    assert torch.equal(forward[off_diagonal], torch.zeros(12, dtype=torch.float64))
    torch.testing.assert_close(forward.diagonal(), -(1 + x.log()), equal_nan=True)
    u = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=torch.float64)
    _, vjp = func.vjp(torch.special.entr, x)
    torch.testing.assert_close(u @ forward, vjp(u)[0], equal_nan=True)


def test_log_ndtr_grad_under_vmap(fallback_warnings: list) -> None:
    # The primitive pinned: over 3 samples auto runs vmap's loop, which the shipped costs measured faster there.
    x = torch.linspace(-30, 5, 12, dtype=torch.float64).reshape(3, 4)
    with registry.use(pins={"special_log_ndtr": "primitive"}):
        grads = func.vmap(func.grad(lambda v: torch.special.log_ndtr(v).sum()))(x)
    assert _fallbacks(fallback_warnings) == []
    expected = torch.func.vmap(func.grad(lambda v: torch.special.log_ndtr(v).sum()))(x)
    torch.testing.assert_close(grads, expected)


def test_isin_with_batched_test_elements(fallback_warnings: list) -> None:
    elements = torch.tensor([1.0, 2.0, float("nan"), -0.0, 7.0])
    tests = torch.tensor([[2.0, 0.0, float("nan")], [7.0, 7.0, 1.0], [5.0, 6.0, 8.0]])
    with registry.use():
        found = func.vmap(torch.isin, in_dims=(None, 0))(elements, tests)
        missing = func.vmap(lambda t: torch.isin(elements, t, invert=True))(tests)
        scalar = func.vmap(lambda t: torch.isin(7, t))(tests.to(torch.int64))
    assert _fallbacks(fallback_warnings) == []
    assert found.tolist() == [[False, True, False, True, False], [True, False, False, False, True],
                              [False, False, False, False, False]]
    assert torch.equal(missing, ~found)
    assert scalar.tolist() == [False, True, False]


def test_histc_ranges_per_sample_under_vmap(fallback_warnings: list) -> None:
    # The primitive pinned: over 3 samples auto runs vmap's loop, which the shipped costs measured faster there.
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, 10.0, 4.0, 4.5]])
    with registry.use(pins={"histc": "primitive"}):
        own_range = func.vmap(lambda v: torch.histc(v, bins=4))(x)
        given = func.vmap(lambda v: torch.histc(v, bins=3, min=0, max=4))(x)
    assert _fallbacks(fallback_warnings) == []
    assert torch.equal(own_range, torch.stack([torch.histc(v, bins=4) for v in x]))
    assert torch.equal(given, torch.stack([torch.histc(v, bins=3, min=0, max=4) for v in x]))


@pytest.mark.parametrize(("call", "message"), [
    (lambda x: torch.quantile(x, 1.5), "quantile() q must be in the range [0, 1] but got 1.5"),
    (lambda x: torch.nanquantile(x, torch.tensor([0.5, -0.1])), "quantile() q values must be in the range [0, 1]"),
    (lambda x: torch.quantile(x, 0.5, interpolation="foo"),
     "quantile() interpolation must be one of linear, lower, higher, midpoint or nearest, but got foo"),
    (lambda x: torch.quantile(x, torch.tensor([0.5], dtype=torch.float64)),
     "quantile() q tensor must be same dtype as the input tensor"),
    (lambda x: torch.histc(x, 0), "torch.histogram(): bins must be > 0, but got 0 for dimension 0"),
    (lambda x: torch.histc(x, 3, 2, 1), "torch.histc: max must be larger than min"),
    (lambda x: torch.histc(x, 3, float("-inf"), 1), "torch.histc: range of [-inf, 1] is not finite"),
    (lambda x: torch.renorm(x, 0, 0, 1.0), "renorm: non-positive-norm not supported"),
])
def test_errors_under_vmap_are_natives(call, message: str) -> None:
    x = torch.rand(2, 3, 4)
    with pytest.raises(RuntimeError) as native:
        func.vmap(call)(x)
    assert message in str(native.value)
    with registry.use(), pytest.raises(RuntimeError, match="^" + message.replace("[", r"\[").replace("(", r"\(")
                                       .replace(")", r"\)").replace("]", r"\]") + "$"):
        func.vmap(call)(x)


@pytest.mark.parametrize(("op", "call"), [
    ("quantile", lambda x: torch.quantile(x, 0.5, dim=5)),
    ("renorm", lambda x: torch.renorm(x, 2, 7, 1.0)),
    ("index_reduce", lambda x: x.index_reduce(5, torch.tensor([0]), torch.ones(3, 1), "prod")),
])
def test_a_dim_out_of_range_is_refused_as_natively(op: str, call) -> None:
    x = torch.rand(3, 4)
    with pytest.raises(IndexError) as native:
        call(x)
    assert str(native.value).startswith("Dimension out of range (expected to be in range of [-2, 1], but got ")
    with registry.use(pins={op: "functional"}), pytest.raises(IndexError, match=re.escape(str(native.value))):
        func.vmap(call)(torch.stack([x, x]))


def test_glu_odd_dimension_error_is_natives_per_sample() -> None:
    # (Native's own batching rule names the physical dimension under vmap: 2 here, where the sample has 2 dims.)
    x = torch.rand(2, 3)
    with pytest.raises(RuntimeError) as native:
        torch.nn.functional.glu(x, 1)
    with pytest.raises(RuntimeError) as composite:
        registry.composites("glu")["functional"].fn(x, 1)
    assert str(composite.value) == str(native.value) == "Halving dimension must be even, but dimension 1 is size 3"


# op -> the stack where native misbehaves (entr: only jacfwd, that is vmap over jvp; glu: only its forward AD)
NATIVE_WRONG = {"special_log_ndtr": "vmap", "special_entr": "vmap(jvp)", "special_chebyshev_polynomial_t": "vmap",
                "isin": "vmap", "isclose": "vmap", "chalf": "vmap", "renorm": "vmap", "glu": "vmap(jvp)",
                "quantile": "vmap", "nanquantile": "vmap", "histc": "vmap"}


@pytest.mark.parametrize("op", sorted(NATIVE_WRONG))
def test_native_kept_where_native_is_right(op: str) -> None:
    assert registry.select(op).kind == "native"
    assert registry.select(op, stack="grad").kind == "native"
    assert registry.select(op, stack=NATIVE_WRONG[op]).kind != "native"
    if NATIVE_WRONG[op] != "vmap":
        assert registry.select(op, stack="vmap").kind == "native"


def test_histogramdd_under_vmap_returns_per_sample_edges() -> None:
    # Natively vmap raises: histogramdd's bin edges are a list of tensors, which vmap's fallback cannot return.
    points = torch.tensor([[[0.0, 1.0], [2.0, 3.0], [1.0, 1.0]], [[5.0, 5.0], [5.0, 6.0], [4.0, 7.0]]])
    with pytest.raises(RuntimeError, match="Batching rule not implemented for aten::histogramdd"):
        func.vmap(lambda p: torch.histogramdd(p, [2, 3]))(points)
    with registry.use():
        hist, edges = func.vmap(lambda p: torch.histogramdd(p, [2, 3]))(points)
    for b in range(2):
        expected = torch.histogramdd(points[b], [2, 3])
        assert torch.equal(hist[b], expected.hist)
        assert all(torch.equal(e[b], x) for e, x in zip(edges, expected.bin_edges, strict=True))


# --- rrelu ------------------------------------------------------------------------------------------------------------


def _rrelu(training: bool):
    return lambda t: torch.nn.functional.rrelu(t, 0.1, 0.6, training)


def test_rrelu_eval_under_vmap_jacfwd_and_vmap_grad_equals_a_loop_of_native(fallback_warnings: list) -> None:
    # OpInfo's first samples are all training=True (random: unsupported under vmap), so eval is checked here.
    x = torch.randn(4, 9, dtype=torch.float64)
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    rrelu = _rrelu(False)
    with registry.use():
        values = func.vmap(rrelu)(x)
        grads = func.vmap(func.grad(lambda t: rrelu(t).sum()))(x)
        jacobian = func.jacfwd(rrelu)(x[1])
    assert _fallbacks(fallback_warnings) == []
    torch.testing.assert_close(values, torch.stack([rrelu(row) for row in x]), rtol=0, atol=0, equal_nan=True)
    expected_grads = []
    for row in x:
        leaf = row.clone().requires_grad_()
        rrelu(leaf).sum().backward()
        expected_grads.append(leaf.grad)
    torch.testing.assert_close(grads, torch.stack(expected_grads), rtol=0, atol=0, equal_nan=True)
    leaf = x[1].clone().requires_grad_()
    expected_jacobian = torch.autograd.functional.jacobian(rrelu, leaf)
    torch.testing.assert_close(jacobian, expected_jacobian, rtol=0, atol=0)


def test_rrelu_routes_when_captured_in_place_and_from_the_module() -> None:
    from torch import rrelu as captured  # a function object taken before use(): routing is at the dispatcher

    x = torch.randn(4, 6, dtype=torch.float64)
    expected = torch.stack([torch.nn.functional.rrelu(row, 0.1, 0.6, False) for row in x])
    with pytest.raises(RuntimeError, match=r"vmap: we do not yet support aten::rrelu_\."):
        func.vmap(lambda t: torch.nn.functional.rrelu(t.clone(), 0.1, 0.6, False, inplace=True))(x)
    with registry.use():
        assert torch.equal(func.vmap(lambda t: captured(t, 0.1, 0.6, False))(x), expected)
        in_place = func.vmap(lambda t: torch.nn.functional.rrelu(t.clone(), 0.1, 0.6, False, inplace=True))(x)
        module = func.vmap(torch.nn.RReLU(0.1, 0.6).eval())(x)
    assert torch.equal(in_place, expected) and torch.equal(module, expected)


@pytest.mark.parametrize("training", [True, False])
def test_rrelu_refuses_lower_above_upper_as_native_does(training: bool) -> None:
    x = torch.randn(3, 5)
    with pytest.raises(RuntimeError, match="Lower bound should be less than or equal to the upper bound"):
        torch.nn.functional.rrelu(x, 0.6, 0.1, training)
    with registry.use(), pytest.raises(RuntimeError,
                                       match="Lower bound should be less than or equal to the upper bound"):
        func.vmap(lambda t: torch.nn.functional.rrelu(t, 0.6, 0.1, training), randomness="different")(x)


def test_rrelu_training_under_grad_and_jacrev_draws_natives_noise() -> None:
    x = torch.randn(12, dtype=torch.float64)
    rrelu = _rrelu(True)
    torch.manual_seed(3)
    leaf = x.clone().requires_grad_()
    expected_out = rrelu(leaf)
    expected_out.sum().backward()
    with registry.use():
        torch.manual_seed(3)
        grad = func.grad(lambda t: rrelu(t).sum())(x)
        torch.manual_seed(3)
        jacobian = func.jacrev(rrelu)(x)
    assert torch.equal(grad, leaf.grad)
    assert torch.equal(jacobian, torch.diag(leaf.grad))  # elementwise: the noise on the diagonal
    assert torch.equal(torch.diagonal(jacobian) * x, expected_out.detach())


def test_rrelu_training_under_vmap_follows_vmaps_randomness_flag(fallback_warnings: list) -> None:
    x = torch.randn(5, 40, dtype=torch.float64)
    rrelu = _rrelu(True)
    with registry.use():
        with pytest.raises(RuntimeError, match="vmap: called random operation while in randomness error mode"):
            func.vmap(rrelu)(x)
        different = func.vmap(rrelu, randomness="different")(x)
        same = func.vmap(rrelu, randomness="same")(x.abs().neg() - 1)
    assert _fallbacks(fallback_warnings) == []
    slopes = different / x
    assert torch.equal(slopes[x > 0], torch.ones_like(slopes[x > 0]))
    negative = slopes[x <= 0]
    assert negative.min() >= 0.1 and negative.max() <= 0.6 and negative.unique().numel() == negative.numel()
    same_slopes = same / (x.abs().neg() - 1)
    assert torch.allclose(same_slopes, same_slopes[:1].expand_as(same_slopes), rtol=1e-12, atol=0)
    assert same_slopes.min() >= 0.1 and same_slopes.max() <= 0.6


# --- hash_tensor ------------------------------------------------------------------------------------------------------

HASH_CASES = [
    (torch.randn(3, 4), {}), (torch.randn(3, 4), {"dim": 0}), (torch.randn(3, 4, 5), {"dim": (0, 2), "keepdim": True}),
    (torch.randn(3, 4), {"dim": -1, "keepdim": True}), (torch.tensor(2.5), {}), (torch.tensor(2.5), {"dim": 0}),
    (torch.randint(-5, 5, (3, 7)), {"dim": 1}), (torch.rand(4, 5) > 0.5, {}), (torch.randn(2, 0, 3), {"dim": 2}),
    (torch.randn(5).half(), {}), (torch.randint(0, 200, (6,), dtype=torch.uint8), {}),
    (torch.randn(7, 3, dtype=torch.float64).t(), {"dim": 1}),
]


@pytest.mark.parametrize(("x", "kwargs"), HASH_CASES)
def test_hash_tensor_equals_natives_bits(x: torch.Tensor, kwargs: dict) -> None:
    expected = torch.hash_tensor(x, **kwargs)
    with registry.use(pins={"hash_tensor": "functional"}):
        batched = func.vmap(lambda t: torch.hash_tensor(t, **kwargs))(torch.stack([x, x.flip(0) if x.dim() else x]))
    looped = torch.stack([expected, torch.hash_tensor(x.flip(0) if x.dim() else x, **kwargs)])
    assert batched.dtype == torch.uint64 and batched.shape == looped.shape
    assert torch.equal(batched.view(torch.int64), looped.view(torch.int64))


@pytest.mark.parametrize(("x", "kwargs", "error", "message"), [
    (torch.randn(2, 0), {}, RuntimeError, "Expected reduction dim to be specified for input.numel() == 0"),
    (torch.randn(2, 0, 3), {"dim": 1}, IndexError, "Expected reduction dim 1 to have non-zero size"),
    (torch.randn(3, 4), {"dim": 5}, IndexError,
     "Dimension out of range (expected to be in range of [-2, 1], but got 5)"),
    (torch.tensor(1.0), {"dim": -2}, IndexError,
     "Dimension out of range (expected to be in range of [-1, 0], but got -2)"),
    (torch.randn(3, 4), {"dim": (0, -2)}, RuntimeError, "dim 0 appears multiple times in the list of dims"),
    (torch.randn(3, 4), {"mode": 1}, RuntimeError, "Unknown hash_tensor mode: 1"),
])
def test_hash_tensor_refuses_what_native_refuses(x: torch.Tensor, kwargs: dict, error: type, message: str) -> None:
    from composites.statistics import hash_tensor_functional

    with pytest.raises(error, match=re.escape(message)):
        torch.hash_tensor(x, **kwargs)
    with pytest.raises(error, match=re.escape(message)):
        hash_tensor_functional(x, **kwargs)


def test_hash_tensor_batches_without_fallback(fallback_warnings: list) -> None:
    with registry.use():
        func.vmap(lambda t: torch.hash_tensor(t, 1))(torch.randn(4, 3, 5))
    assert _fallbacks(fallback_warnings) == []
