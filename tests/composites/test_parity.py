"""Drop-in parity: every composite rejects what native PyTorch rejects, with the same exception type, in eager mode
and under vmap, grad and jvp; and on valid inputs returns what native returns in everything but speed (dtype,
shape, strides, aliasing, requires_grad, warnings, values).

Composites are called directly (``registry.composites(op)[name].fn``), transforms through ``torch.func`` on a
function that calls the composite, so this holds whatever ``use()`` routes to.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import func

import registry
from registry.harness.samples import PARITY_SAMPLES, SAMPLES, Args, Sample, fault_name, fault_samples
from registry.harness.verify import native_rejection, rejection

NON_NATIVE = ("mutating", "functional", "primitive")
# The transform contexts every fault runs in: (stack, batching pattern).
CONTEXTS = (("vmap",), "all"), (("vmap",), "self"), (("grad",), "-"), (("jvp",), "-"), (("vmap", "grad"), "all")


def _call(fn: Any, sample: Sample, args: Args) -> Any:
    positional = [value for name, value in args.items() if name not in sample.kwargs]
    return fn(*positional, **{name: args[name] for name in sample.kwargs if name in args})


def _composite(op: str, name: str) -> Any:
    return registry.composites(op)[name].fn


def _faults() -> list[Sample]:
    return [sample for op in SAMPLES for sample in fault_samples(op)]


def _invalid() -> list[Sample]:
    return [sample for sample in _faults() if native_rejection(sample) is not None]


def _edges() -> list[Sample]:
    """Fault candidates that native accepts: edges of the valid inputs."""
    return [sample for sample in _faults() if native_rejection(sample) is None]


def _names(op_samples: list[Sample]) -> list[str]:
    return [sample.id for sample in op_samples]


# --- the two cases the issue reports -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", NON_NATIVE)
def test_masked_fill_rejects_a_value_with_dimensions(kind: str) -> None:
    self, mask = torch.zeros(2, 3), torch.tensor([[True, False, True], [False, True, False]])
    with pytest.raises(RuntimeError) as native:
        torch.masked_fill(self, mask, torch.tensor([1.0]))
    with pytest.raises(RuntimeError) as composite:
        _composite("masked_fill", kind)(self, mask, torch.tensor([1.0]))
    assert str(composite.value) == str(native.value) == (
        "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with 1 dimension(s).")
    with pytest.raises(RuntimeError, match="only supports a 0-dimensional value tensor"):
        func.vmap(lambda x: _composite("masked_fill", kind)(x, mask, torch.tensor([1.0])))(self[None])


@pytest.mark.parametrize("kind", NON_NATIVE)
def test_masked_scatter_rejects_a_uint8_mask(kind: str) -> None:
    self, source = torch.zeros(2, 3), torch.arange(6.0)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.uint8)
    with pytest.raises(RuntimeError) as native, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # native warns that uint8 masks are deprecated, then raises
        torch.masked_scatter(self, mask, source)
    with pytest.raises(RuntimeError) as composite:
        _composite("masked_scatter", kind)(self, mask, source)
    assert str(composite.value) == str(native.value) == (
        "masked_scatter_ only supports boolean masks, but got mask with dtype Byte")
    with pytest.raises(RuntimeError, match="only supports boolean masks"):
        func.grad(lambda x: _composite("masked_scatter", kind)(x, mask, source).sum())(self)


# --- generated invalid inputs ------------------------------------------------------------------------------------


def test_faults_are_generated_from_the_schema() -> None:
    generated = {op: sorted(fault_name(s) for s in fault_samples(op)) for op in SAMPLES}
    assert generated["masked_fill"] == [
        "mask:device", "mask:float", "mask:shape", "mask:uint8", "mask:wider", "value:bool", "value:complex",
        "value:device", "value:int", "value:other-dtype", "value:rank1"]
    assert generated["index_add"] == [
        "alpha:complex", "dim:too-large", "dim:too-negative", "index:device", "index:float", "index:int32",
        "index:negative", "index:rank2", "index:too-large", "index:too-negative", "source:device", "source:dtype",
        "source:rank", "source:slice-shape", "source:too-small"]
    assert generated["to"] == ["layout:sparse", "memory_format:channels_last-rank", "memory_format:preserve"]
    invalid = {(s.op, fault_name(s)) for s in _invalid()}
    assert ("masked_fill", "value:rank1") in invalid and ("masked_scatter", "mask:uint8") in invalid
    assert ("index_add", "index:int32") not in invalid and ("index_copy", "index:int32") in invalid
    assert ("index_fill", "index:negative") not in invalid and ("index_fill", "index:too-negative") in invalid
    assert len(invalid) == 54


@pytest.mark.parametrize("kind", NON_NATIVE)
@pytest.mark.parametrize("sample", _invalid(), ids=_names(_invalid()))
def test_invalid_input_raises_as_native_in_eager_mode(sample: Sample, kind: str) -> None:
    """Same exception type; the message is native's own or names the op."""
    expected = native_rejection(sample)
    with pytest.raises(Exception) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _call(_composite(sample.op, kind), sample, sample.build(0))
    assert type(raised.value) is type(expected), f"{raised.value!r} where native raises {expected!r}"
    message = str(raised.value)
    assert message == str(expected) or sample.op in message, f"{message!r} names neither {sample.op} nor native's"


# Where native itself, under a transform, accepts what it rejects per sample (its batching rules skip the check):
# composites keep rejecting. Each entry is asserted, so a PyTorch that fixes one fails here until it is removed.
# (index_copy's batching rule rewrites it as a scatter; with a meta tensor vmap runs native's meta kernels.)
NATIVE_ACCEPTS_UNDER_VMAP = {
    *(("index_copy", fault, ("vmap",), pattern) for fault in ("index:int32", "index:rank2", "index:device",
                                                              "source:slice-shape", "source:device")
      for pattern in ("all", "self")),
    ("index_copy", "source:slice-shape", ("vmap", "grad"), "all"),
    ("index_copy", "source:device", ("vmap", "grad"), "all"),
    ("contiguous", "memory_format:preserve", ("vmap", "grad"), "all"),
}


def _transform_cases() -> list[tuple[Sample, tuple[str, ...], str]]:
    return [(sample, stack, pattern) for sample in _invalid() for stack, pattern in CONTEXTS]


def _transform_ids() -> list[str]:
    return [f"{sample.id}-{','.join(stack)}-{pattern}" for sample, stack, pattern in _transform_cases()]


@pytest.mark.parametrize(("sample", "stack", "pattern"), _transform_cases(), ids=_transform_ids())
def test_invalid_input_raises_as_native_under_transforms(sample: Sample, stack: tuple[str, ...], pattern: str) -> None:
    """Every composite raises; its type is native's per-sample type, or native's own type in that context."""
    expected = native_rejection(sample)
    native = rejection(sample, stack, pattern, lambda args: _call(_composite(sample.op, "native"), sample, args))
    key = (sample.op, fault_name(sample), stack, pattern)
    assert (native is None) == (key in NATIVE_ACCEPTS_UNDER_VMAP), f"native under {stack}: {native!r}"
    allowed = {type(expected)} | ({type(native)} if native is not None else set())
    for kind in NON_NATIVE:
        raised = rejection(sample, stack, pattern, lambda args, k=kind: _call(_composite(sample.op, k), sample, args))
        assert raised is not None, f"{kind} accepts {fault_name(sample)} under {stack}; native raises {expected!r}"
        assert type(raised) in allowed, f"{kind} raises {raised!r}; native raises {expected!r} / {native!r}"


# --- result parity on valid inputs ---------------------------------------------------------------------------------


def _valid() -> list[Sample]:
    return [s for samples in SAMPLES.values() for s in samples] + [
        s for samples in PARITY_SAMPLES.values() for s in samples] + _edges()


def _requiring_grad(sample: Sample, args: Args) -> Args:
    return {name: value.detach().requires_grad_()
            if name in sample.differentiable and isinstance(value, torch.Tensor) and value.is_floating_point()
            else value for name, value in args.items()}


def _observed(fn: Any, sample: Sample, args: Args) -> tuple[Any, tuple[Any, ...]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _call(fn, sample, args)
    summary = (out.dtype, tuple(out.shape), out.stride(), out is args["self"], out.requires_grad,
               tuple(str(w.message) for w in caught))
    return out, summary


@pytest.mark.parametrize("kind", NON_NATIVE)
@pytest.mark.parametrize("sample", _valid(), ids=_names(_valid()))
def test_valid_input_returns_what_native_returns(sample: Sample, kind: str) -> None:
    """dtype, shape, strides, aliasing (``is self``), requires_grad, warnings and values, with and without grad."""
    for with_grad in (False, True) if sample.differentiable else (False,):
        args = sample.build(0)
        args = _requiring_grad(sample, args) if with_grad else args
        expected, expected_summary = _observed(_composite(sample.op, "native"), sample, args)
        actual, actual_summary = _observed(_composite(sample.op, kind), sample, args)
        assert actual_summary == expected_summary
        torch.testing.assert_close(actual.detach(), expected.detach(), equal_nan=True)


def test_to_and_contiguous_return_self_when_nothing_changes() -> None:
    x = torch.randn(3, 4)
    for kind in NON_NATIVE:
        assert _composite("to", kind)(x, dtype=torch.float32) is x
        assert _composite("to", kind)(x, dtype=torch.float32, copy=True) is not x
        assert _composite("contiguous", kind)(x) is x
        assert _composite("contiguous", kind)(x.t()) is not x


@pytest.mark.parametrize("kind", NON_NATIVE)
def test_index_fill_index_range_is_natives(kind: str) -> None:
    """Indices from -size to size - 1 fill (the functional and primitive composites used to wrap every index modulo
    size, so -6 filled row 4 of 5 where native raises)."""
    self = torch.zeros(5, 2)
    filled = _composite("index_fill", kind)(self, 0, torch.tensor([-5, 4]), 1.0)
    torch.testing.assert_close(filled, torch.index_fill(self, 0, torch.tensor([-5, 4]), 1.0))
    for index in (-6, 5):
        with pytest.raises(IndexError) as native:
            torch.index_fill(self, 0, torch.tensor([index]), 1.0)
        with pytest.raises(IndexError) as composite:
            _composite("index_fill", kind)(self, 0, torch.tensor([index]), 1.0)
        assert str(native.value) == f"index {index} is out of bounds for dimension 0 with size 5"
        if kind != "mutating":
            assert str(composite.value) == ("index_fill(): index out of bounds for dimension 0 with size 5: every "
                                            "index must lie in [-5, 5)")


@pytest.mark.parametrize("kind", NON_NATIVE)
def test_index_add_float_alpha_truncates_for_integers(kind: str) -> None:
    """Native converts alpha to self's type: 2.5 adds 2 * source to an int64 tensor (it used to promote to float
    and fail in scatter_add)."""
    self, index, source = torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.tensor([3, 4])
    result = _composite("index_add", kind)(self, 0, index, source, alpha=-2.5)
    assert result.dtype == torch.int64 and result.tolist() == [-5, 2, -5]
    assert result.tolist() == torch.index_add(self, 0, index, source, alpha=-2.5).tolist()
