"""The fused bodies of the primitives: bit-exact against PyTorch (NaN payloads, infinities and -0.0 where the mask is
False come out as in self), in the one-pass C kernels and in the eager formulation alike, for float, integer and bool
dtypes; and the lighter functorch path gives what functorch's own path gives."""

from __future__ import annotations

import pytest
import torch
from torch import func

import registry
from composites import fused, native_kernels
from composites.masked import Fill, MaskedScatter
from registry.core.primitive import apply
from registry.harness.checks import PATTERNS, STACKS, check, skip_reason
from registry.harness.samples import SAMPLES

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool)


@pytest.fixture(params=["c-kernels", "eager"])
def path(request):
    """Each test runs once on the one-pass C kernels and once on the eager formulation."""
    native_kernels.set_enabled(request.param == "c-kernels")
    yield request.param
    native_kernels.set_enabled(True)


def _special(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    flat = values.view(-1)
    flat[0], flat[1], flat[2], flat[3] = float("nan"), float("inf"), float("-inf"), -0.0
    # A NaN with a payload: the bits must survive, not just "some NaN".
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[dtype]
    flat.view(bits)[4] = flat.view(bits)[0] | 1
    return values


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def test_c_kernels_build_here() -> None:
    assert native_kernels.available(), native_kernels.failure()
    assert 0 < native_kernels.COMPILE_SECONDS["kernels.c"] < 120


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_select_is_torch_where_bit_for_bit(dtype: torch.dtype, path: str) -> None:
    mask = torch.rand(6, 33, generator=torch.Generator().manual_seed(3)) > 0.5
    a, b = _special((6, 33), dtype, 1), _special((6, 33), dtype, 2)
    zero = torch.zeros((), dtype=dtype)
    for x, y in ((a, b), (None, b), (a, None), (a[:, :1], b), (a, b[0]), (a[0, 0], b)):
        got = fused.select(mask, x, y)
        want = torch.where(mask, zero if x is None else x, zero if y is None else y)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(_bits(got), _bits(want)), (dtype, path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_in_order_is_native_masked_scatter_per_sample(dtype: torch.dtype, path: str) -> None:
    g = torch.Generator().manual_seed(5)
    self, source = _special((4, 3, 7), dtype, 6), _special((4, 30), dtype, 7)
    mask = torch.rand(4, 3, 7, generator=g) > 0.4
    got = fused.scatter_in_order(self, mask, source, 1)
    want = torch.stack([s.masked_scatter(m, src) for s, m, src in zip(self, mask, source, strict=True)])
    assert torch.equal(_bits(got), _bits(want))
    back = fused.gather_in_order(got, mask, (4, 30), 1)
    for sample in range(4):
        count = int(mask[sample].sum())
        assert torch.equal(_bits(back[sample, :count]), _bits(got[sample][mask[sample]]))
        assert not back[sample, count:].any()


def test_scatter_with_too_short_a_source_raises(path: str) -> None:
    self, mask = torch.zeros(2, 4), torch.tensor([[True, True, True, False], [True, False, False, False]])
    with pytest.raises(RuntimeError, match="masked_scatter: .*more Trues than source has elements"):
        fused.scatter_in_order(self, mask, torch.ones(2, 2), 1)


def test_index_fill_fills_every_listed_slice_once() -> None:
    self = torch.arange(12.0).reshape(3, 4)
    got = fused.index_fill(self, 1, torch.tensor([0, 2, 2]), torch.tensor([[10.0], [20.0], [30.0]]))
    assert torch.equal(got, torch.tensor([[10.0, 1, 10, 3], [20, 5, 20, 7], [30, 9, 30, 11]]))


def test_light_path_matches_functorch_path() -> None:
    """apply() (per-level unwrap, cached single-level Function) against Function.apply (functorch's own path)."""
    g = torch.Generator().manual_seed(0)
    x, source = torch.randn(5, 3, 4, generator=g, dtype=torch.float64), torch.randn(5, 12, generator=g,
                                                                                   dtype=torch.float64)
    mask = torch.rand(5, 3, 4, generator=g) > 0.5

    def light(x, m, s):
        return (apply(MaskedScatter, x, m, s.reshape(3, 4), 0) ** 2).sum() + apply(Fill, x, m, s[0]).sum()

    def functorch(x, m, s):
        return (MaskedScatter.apply(x, m, s.reshape(3, 4), 0) ** 2).sum() + Fill.apply(x, m, s[0]).sum()

    for make in (lambda f: func.vmap(func.grad(f, argnums=(0, 2))), lambda f: func.vmap(func.jacfwd(f, argnums=2)),
                 lambda f: func.vmap(func.hessian(f))):
        torch.testing.assert_close(make(light)(x, mask, source), make(functorch)(x, mask, source), rtol=0, atol=0)


PRIMITIVE_STACKS = [s for s in STACKS if s not in ("compile", "functionalize")]  # rules mark those invalid


@pytest.mark.parametrize("stack", PRIMITIVE_STACKS)
@pytest.mark.parametrize("op", ["masked_scatter", "masked_fill", "index_fill", "index_add", "index_copy"])
def test_fused_primitive_under_every_stack(op: str, stack: str) -> None:
    """The fused primitive, pinned, under every stack and batching pattern, against the Python loop of native
    PyTorch (the harness of test_stacks, which under policy auto mostly runs the functional composites)."""
    failures = []
    for sample in SAMPLES[op]:
        for pattern in PATTERNS:
            if skip_reason(sample, stack, pattern):
                continue
            with registry.use(pins={op: "primitive"}):
                outcome = check(sample, stack, pattern)
            if outcome.status != "ok":
                failures.append(f"{sample.id} {stack} {pattern}: {outcome.status} {outcome.detail}")
    assert failures == []


def test_c_kernels_refuse_tensors_without_memory_of_their_own() -> None:
    """Forward AD's efficient zero tangents have no memory (a C kernel reading them crashed the full matrix under
    grad(jvp(vmap))); lazily-applied neg views hold other values than they show."""
    zeros = torch._efficientzerotensor(4, 5)
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) > 0.5
    assert not native_kernels.usable(mask, zeros)
    assert torch.equal(fused.select(mask, None, zeros), torch.zeros(4, 5))
    negated = torch.randn(4, 5, dtype=torch.complex64).conj().imag  # a neg view: is_neg() is True
    assert negated.is_neg() and not native_kernels.usable(negated)
    assert torch.equal(fused.select(mask, negated, None), torch.where(mask, negated, 0))
    assert native_kernels.usable(mask, torch.randn(4, 5))
