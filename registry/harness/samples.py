"""Sample inputs for every covered op: the overloads and corner cases each composite must agree with PyTorch on.

A sample is a factory: called with a seed it returns fresh arguments of the same shapes, so a batch is built by
calling it once per sample and stacking the tensors that the batching pattern batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Args = dict[str, Any]  # schema name -> value, in schema order


@dataclass(frozen=True)
class Sample:
    op: str
    name: str
    dtype: torch.dtype
    factory: Callable[[torch.Generator], Args]
    # Tensor arguments that may carry a batch, and those gradients are taken with respect to (float only).
    batchable: tuple[str, ...]
    differentiable: tuple[str, ...]
    kwargs: tuple[str, ...] = field(default=())  # names passed by keyword (keyword-only in the schema)

    def build(self, seed: int) -> Args:
        generator = torch.Generator().manual_seed(seed)
        return self.factory(generator)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}-{str(self.dtype).removeprefix('torch.')}"


def _values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-9, 10, shape, generator=g, dtype=dtype)


def _index(size: int, count: int, g: torch.Generator, *, unique: bool) -> torch.Tensor:
    if unique:
        return torch.randperm(size, generator=g)[:count]
    return torch.randint(0, size, (count,), generator=g)


def _mask(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g) > 0.5


def _fill_value(dtype: torch.dtype, g: torch.Generator, *, as_tensor: bool) -> Any:
    value = _values((), dtype, g)
    return value if as_tensor else value.item()


FLOATS = (torch.float64, torch.float32)
INTEGRAL = (torch.int64, torch.bool)


def _index_add_samples() -> list[Sample]:
    samples = []
    for dtype in (*FLOATS, torch.int64):
        alpha = 2 if dtype == torch.int64 else 2.5
        diff = ("self", "source") if dtype.is_floating_point else ()
        samples += [
            Sample("index_add", "dim0-repeated", dtype, lambda g, d=dtype: {
                "self": _values((5, 4), d, g), "dim": 0, "index": _index(5, 6, g, unique=False),
                "source": _values((6, 4), d, g)}, ("self", "index", "source"), diff),
            Sample("index_add", "negdim-alpha", dtype, lambda g, d=dtype, a=alpha: {
                "self": _values((3, 4, 5), d, g), "dim": -1, "index": _index(5, 2, g, unique=True),
                "source": _values((3, 4, 2), d, g), "alpha": a}, ("self", "index", "source"), diff, ("alpha",)),
        ]
    samples.append(Sample("index_add", "dim0-repeated", torch.bool, lambda g: {
        "self": _values((5, 4), torch.bool, g), "dim": 0, "index": _index(5, 6, g, unique=False),
        "source": _values((6, 4), torch.bool, g)}, ("self", "index", "source"), ()))
    samples += [
        Sample("index_add", "0d", torch.float64, lambda g: {
            "self": _values((), torch.float64, g), "dim": 0, "index": torch.tensor([0]),
            "source": _values((), torch.float64, g)}, ("self", "source"), ("self", "source")),
        Sample("index_add", "empty-index", torch.float64, lambda g: {
            "self": _values((4, 3), torch.float64, g), "dim": 1, "index": torch.zeros(0, dtype=torch.long),
            "source": _values((4, 0), torch.float64, g)}, ("self",), ("self",)),
    ]
    return samples


def _index_copy_samples() -> list[Sample]:
    samples = []
    for dtype in (*FLOATS, *INTEGRAL):
        diff = ("self", "source") if dtype.is_floating_point else ()
        samples += [
            Sample("index_copy", "dim0", dtype, lambda g, d=dtype: {
                "self": _values((5, 4), d, g), "dim": 0, "index": _index(5, 3, g, unique=True),
                "source": _values((3, 4), d, g)}, ("self", "index", "source"), diff),
            Sample("index_copy", "negdim", dtype, lambda g, d=dtype: {
                "self": _values((3, 4, 5), d, g), "dim": -2, "index": _index(4, 2, g, unique=True),
                "source": _values((3, 2, 5), d, g)}, ("self", "index", "source"), diff),
        ]
    samples += [
        Sample("index_copy", "0d", torch.float64, lambda g: {
            "self": _values((), torch.float64, g), "dim": 0, "index": torch.tensor([0]),
            "source": _values((), torch.float64, g)}, ("self", "source"), ("self", "source")),
        Sample("index_copy", "empty-index", torch.float64, lambda g: {
            "self": _values((4, 3), torch.float64, g), "dim": 0, "index": torch.zeros(0, dtype=torch.long),
            "source": _values((0, 3), torch.float64, g)}, ("self",), ("self",)),
    ]
    return samples


def _index_fill_samples() -> list[Sample]:
    samples = []
    for dtype in (*FLOATS, *INTEGRAL):
        floating = dtype.is_floating_point
        samples += [
            Sample("index_fill", "scalar-repeated", dtype, lambda g, d=dtype: {
                "self": _values((5, 4), d, g), "dim": 0, "index": _index(5, 3, g, unique=False),
                "value": _fill_value(d, g, as_tensor=False)}, ("self", "index"), ("self",) if floating else ()),
            Sample("index_fill", "tensor-negdim", dtype, lambda g, d=dtype: {
                "self": _values((3, 4, 5), d, g), "dim": -1, "index": _index(5, 2, g, unique=True),
                "value": _fill_value(d, g, as_tensor=True)}, ("self", "index", "value"),
                ("self", "value") if floating else ()),
        ]
    samples += [
        Sample("index_fill", "0d", torch.float64, lambda g: {
            "self": _values((), torch.float64, g), "dim": 0, "index": torch.tensor([0]),
            "value": _fill_value(torch.float64, g, as_tensor=True)}, ("self", "value"), ("self", "value")),
        Sample("index_fill", "negative-index", torch.float64, lambda g: {
            "self": _values((4, 3), torch.float64, g), "dim": 1, "index": _index(3, 2, g, unique=True) - 3,
            "value": _fill_value(torch.float64, g, as_tensor=True)}, ("self", "index", "value"), ("self", "value")),
        Sample("index_fill", "empty-index", torch.float64, lambda g: {
            "self": _values((4, 3), torch.float64, g), "dim": 1, "index": torch.zeros(0, dtype=torch.long),
            "value": _fill_value(torch.float64, g, as_tensor=True)}, ("self", "value"), ("self", "value")),
    ]
    return samples


def _masked_fill_samples() -> list[Sample]:
    samples = []
    for dtype in (*FLOATS, *INTEGRAL):
        floating = dtype.is_floating_point
        samples += [
            Sample("masked_fill", "scalar", dtype, lambda g, d=dtype: {
                "self": _values((4, 5), d, g), "mask": _mask((4, 5), g),
                "value": _fill_value(d, g, as_tensor=False)}, ("self", "mask"), ("self",) if floating else ()),
            Sample("masked_fill", "tensor-broadcast-mask", dtype, lambda g, d=dtype: {
                "self": _values((3, 4, 5), d, g), "mask": _mask((4, 1), g),
                "value": _fill_value(d, g, as_tensor=True)}, ("self", "mask", "value"),
                ("self", "value") if floating else ()),
        ]
    samples.append(Sample("masked_fill", "0d", torch.float64, lambda g: {
        "self": _values((), torch.float64, g), "mask": _mask((), g),
        "value": _fill_value(torch.float64, g, as_tensor=True)}, ("self", "mask", "value"), ("self", "value")))
    return samples


def _masked_scatter_samples() -> list[Sample]:
    samples = []
    for dtype in (*FLOATS, *INTEGRAL):
        diff = ("self", "source") if dtype.is_floating_point else ()
        samples += [
            Sample("masked_scatter", "same-shape", dtype, lambda g, d=dtype: {
                "self": _values((4, 5), d, g), "mask": _mask((4, 5), g), "source": _values((4, 5), d, g)},
                ("self", "mask", "source"), diff),
            Sample("masked_scatter", "broadcast-mask", dtype, lambda g, d=dtype: {
                "self": _values((3, 4), d, g), "mask": _mask((4,), g), "source": _values((15,), d, g)},
                ("self", "mask", "source"), diff),
        ]
    samples.append(Sample("masked_scatter", "0d", torch.float64, lambda g: {
        "self": _values((), torch.float64, g), "mask": _mask((), g), "source": _values((2,), torch.float64, g)},
        ("self", "mask", "source"), ("self", "source")))
    return samples


def _contiguous_samples() -> list[Sample]:
    samples = []
    for dtype in (torch.float64, torch.float32, torch.int64):
        diff = ("self",) if dtype.is_floating_point else ()
        samples += [
            Sample("contiguous", "transposed", dtype, lambda g, d=dtype: {"self": _values((5, 4), d, g).t()},
                   ("self",), diff),
            Sample("contiguous", "channels-last", dtype, lambda g, d=dtype: {
                "self": _values((2, 3, 4, 5), d, g), "memory_format": torch.channels_last}, ("self",), diff,
                ("memory_format",)),
        ]
    samples.append(Sample("contiguous", "already", torch.float64, lambda g: {"self": _values((3, 4), torch.float64, g)},
                          ("self",), ("self",)))
    return samples


def _to_samples() -> list[Sample]:
    return [
        Sample("to", "float64-to-float32", torch.float64, lambda g: {
            "self": _values((3, 4), torch.float64, g), "dtype": torch.float32}, ("self",), ("self",), ("dtype",)),
        Sample("to", "float32-to-float64", torch.float32, lambda g: {
            "self": _values((3, 4), torch.float32, g), "dtype": torch.float64}, ("self",), ("self",), ("dtype",)),
        Sample("to", "copy-same-dtype", torch.float64, lambda g: {
            "self": _values((3, 4), torch.float64, g), "dtype": torch.float64, "copy": True}, ("self",), ("self",),
            ("dtype", "copy")),
        Sample("to", "channels-last", torch.float64, lambda g: {
            "self": _values((2, 3, 4, 5), torch.float64, g), "memory_format": torch.channels_last}, ("self",),
            ("self",), ("memory_format",)),
        Sample("to", "device-and-dtype", torch.float64, lambda g: {
            "self": _values((4,), torch.float64, g), "device": "cpu", "dtype": torch.float32}, ("self",),
            ("self",), ("device", "dtype")),
        Sample("to", "float-to-int", torch.float64, lambda g: {
            "self": _values((3, 4), torch.float64, g) * 5, "dtype": torch.int64}, ("self",), (), ("dtype",)),
        Sample("to", "int-to-bool", torch.int64, lambda g: {
            "self": _values((3, 4), torch.int64, g), "dtype": torch.bool}, ("self",), (), ("dtype",)),
    ]


SAMPLES: dict[str, list[Sample]] = {
    "index_add": _index_add_samples(),
    "index_copy": _index_copy_samples(),
    "index_fill": _index_fill_samples(),
    "masked_fill": _masked_fill_samples(),
    "masked_scatter": _masked_scatter_samples(),
    "contiguous": _contiguous_samples(),
    "to": _to_samples(),
}


def all_samples() -> list[Sample]:
    return [sample for samples in SAMPLES.values() for sample in samples]


# --- invalid inputs, generated from the schema ------------------------------------------------------------------
#
# Every parameter of an op's ATen schema gets the faults its type and role allow: a tensor the wrong dtype, rank or
# device, an index out of range, a ``dim`` out of range, a memory format or layout the op refuses. Each fault is
# applied to a valid float sample, so it keeps that sample's shapes, batching and differentiable arguments. A fault is
# a candidate: where native accepts it (an int32 index for ``index_add``, a float64 value for a float32 tensor), it is
# an edge of the valid inputs and composites must accept it too, with native's result; where native rejects it, every
# composite must reject it with the same exception type, in eager mode and under every transform.

Fault = Callable[[Args], Args]


def _with(args: Args, name: str, value: Any) -> Args:
    return {**args, name: value}


def _dim_size(args: Args) -> int:
    self = args["self"]
    return self.shape[args["dim"]] if self.dim() else 1


def _set_first(index: torch.Tensor, value: int) -> torch.Tensor:
    index = index.clone()
    index.reshape(-1)[0] = value
    return index


def _other_float(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else torch.float64


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    # The one other device every build has; native checks devices before it looks at data.
    return torch.empty_like(tensor, device="meta")


def _fewer_sources(args: Args) -> Args:
    """masked_scatter with every mask element True and one source element fewer than self has."""
    return {**args, "mask": torch.ones_like(args["mask"]), "source": args["source"].reshape(-1)[:-1]}


def _tensor_faults(op: str, name: str) -> dict[str, Fault]:
    """Faults of a tensor parameter, by its role (the schema says Tensor; the role says which dtypes and ranks)."""
    if name == "mask":
        return {
            "mask:uint8": lambda a: _with(a, "mask", a["mask"].to(torch.uint8)),
            "mask:float": lambda a: _with(a, "mask", a["mask"].to(a["self"].dtype)),
            "mask:shape": lambda a: _with(a, "mask", torch.ones(a["self"].shape[-1] + 2, dtype=torch.bool)),
            "mask:wider": lambda a: _with(a, "mask", torch.stack([a["mask"], ~a["mask"]])[:, None]),
            **({} if op == "masked_scatter" else {"mask:device": lambda a: _with(a, "mask", _on_meta(a["mask"]))}),
        }
    if name == "index":
        return {
            "index:float": lambda a: _with(a, "index", a["index"].to(torch.float32)),
            "index:int32": lambda a: _with(a, "index", a["index"].to(torch.int32)),
            "index:rank2": lambda a: _with(a, "index", a["index"].reshape(1, -1)),
            "index:too-large": lambda a: _with(a, "index", _set_first(a["index"], _dim_size(a))),
            "index:negative": lambda a: _with(a, "index", _set_first(a["index"], -1)),
            "index:too-negative": lambda a: _with(a, "index", _set_first(a["index"], -_dim_size(a) - 1)),
            "index:device": lambda a: _with(a, "index", _on_meta(a["index"])),
        }
    if name == "source":
        faults = {
            "source:dtype": lambda a: _with(a, "source", a["source"].to(_other_float(a["source"].dtype))),
            "source:too-small": _fewer_sources if op == "masked_scatter"
            else lambda a: _with(a, "source", a["source"].narrow(a["dim"], 0, 1)),
        }
        if op != "masked_scatter":
            faults["source:slice-shape"] = lambda a: _with(a, "source", torch.cat([a["source"], a["source"]], -1))
            faults["source:rank"] = lambda a: _with(a, "source", a["source"][..., None])
            faults["source:device"] = lambda a: _with(a, "source", _on_meta(a["source"]))
        return faults
    if name == "value":
        return {
            "value:rank1": lambda a: _with(a, "value", a["value"].reshape(1)),
            "value:complex": lambda a: _with(a, "value", a["value"].to(torch.complex64) + 1j),
            "value:other-dtype": lambda a: _with(a, "value", a["value"].to(_other_float(a["value"].dtype))),
            "value:int": lambda a: _with(a, "value", a["value"].to(torch.int64)),
            "value:bool": lambda a: _with(a, "value", a["value"] > 0),
            **({"value:device": lambda a: _with(a, "value", _on_meta(a["value"]))} if op == "masked_fill" else {}),
        }
    return {}


def _scalar_faults(name: str) -> dict[str, Fault]:
    if name == "dim":
        return {
            "dim:too-large": lambda a: _with(a, "dim", a["self"].dim() or 1),
            "dim:too-negative": lambda a: _with(a, "dim", -(a["self"].dim() or 1) - 1),
        }
    if name == "alpha":
        return {"alpha:complex": lambda a: _with(a, "alpha", 2j)}
    if name == "memory_format":
        return {
            "memory_format:preserve": lambda a: _with(a, "memory_format", torch.preserve_format),
            "memory_format:channels_last-rank": lambda a: _with(a, "memory_format", torch.channels_last)
            if a["self"].dim() != 4 else _with(a, "memory_format", torch.channels_last_3d),
        }
    if name == "layout":
        return {"layout:sparse": lambda a: _with(a, "layout", torch.sparse_coo)}
    return {}


def _schema_arguments(op: str) -> list[Any]:
    from registry.core.ops import OPS  # the core imports this module's users, not this module
    from registry.core.registration import load

    load()
    packet = getattr(torch.ops.aten, op)
    return list(getattr(packet, OPS[op].overload or "default")._schema.arguments)


def _base_sample(op: str, dtype: torch.dtype) -> Sample | None:
    """The sample of ``dtype`` with the most tensor arguments (a tensor ``value`` rather than a number)."""
    candidates = [s for s in SAMPLES[op] if s.dtype == dtype]
    if not candidates:
        return None
    return max(candidates, key=lambda s: sum(isinstance(v, torch.Tensor) for v in s.build(0).values()))


@functools.cache
def fault_samples(op: str, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> tuple[Sample, ...]:
    """Every fault the schema of ``op`` allows, applied to its base sample of each dtype (see the section comment)."""
    return tuple(sample for dtype in dtypes for sample in _fault_samples(op, dtype))


def _fault_samples(op: str, dtype: torch.dtype) -> list[Sample]:
    base = _base_sample(op, dtype)
    if base is None:
        return []
    present = base.build(0)
    samples = []
    for argument in _schema_arguments(op):
        if isinstance(argument.type, torch._C.TensorType):
            faults = _tensor_faults(op, argument.name)
        else:
            faults = _scalar_faults(argument.name)
        for fault_name, fault in faults.items():
            if argument.name not in present and argument.name not in ("alpha", "memory_format", "layout"):
                continue
            added = argument.kwarg_only and argument.name not in base.kwargs
            kwargs = base.kwargs + ((argument.name,) if added else ())
            samples.append(Sample(
                op, f"{base.name}+{fault_name}", base.dtype,
                lambda g, f=fault, b=base: f(b.factory(g)), base.batchable, base.differentiable, kwargs,
            ))
    return samples


def fault_name(sample: Sample) -> str:
    return sample.name.partition("+")[2]


# --- result-parity edges ----------------------------------------------------------------------------------------
#
# Valid inputs whose result differs in metadata more than in values: a transposed or channels-last self (native's
# out-of-place index_add, index_copy, masked_fill and masked_scatter return contiguous tensors, index_fill keeps
# self's strides), values of another dtype or a Python number of another kind (the result keeps self's dtype), a
# mask wider than self (the result takes the broadcast shape), and no-op conversions (``to``/``contiguous`` return
# self itself). Compared with native in eager mode (dtype, shape, strides, aliasing, requires_grad, warnings,
# values) by ``tests/composites/test_parity.py``; not part of the transform matrix.


def _parity(op: str, name: str, build: Callable[[torch.Generator], Args], kwargs: tuple[str, ...] = (),
            differentiable: tuple[str, ...] = ("self",)) -> Sample:
    with torch._C._DisableFuncTorch():  # built at import, which may happen inside a transform: below them all
        dtype = build(torch.Generator().manual_seed(0))["self"].dtype
    return Sample(op, name, dtype, build, ("self",), differentiable if dtype.is_floating_point else (), kwargs)


def _transposed(shape: tuple[int, int], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return _values(shape[::-1], dtype, g).t()


def _channels_last(g: torch.Generator) -> torch.Tensor:
    return _values((2, 3, 4, 5), torch.float32, g).contiguous(memory_format=torch.channels_last)


PARITY_SAMPLES: dict[str, list[Sample]] = {
    "index_add": [
        _parity("index_add", "transposed-self", lambda g: {
            "self": _transposed((5, 4), torch.float32, g), "dim": 0, "index": _index(5, 2, g, unique=False),
            "source": _values((2, 4), torch.float32, g)}),
        _parity("index_add", "int-self-float-alpha", lambda g: {
            "self": _values((5,), torch.int64, g), "dim": 0, "index": _index(5, 3, g, unique=False),
            "source": _values((3,), torch.int64, g), "alpha": -2.5}, ("alpha",)),
        _parity("index_add", "0d-index", lambda g: {
            "self": _values((5, 4), torch.float32, g), "dim": 1, "index": torch.tensor(2),
            "source": _values((5, 1), torch.float32, g)}),
    ],
    "index_copy": [
        _parity("index_copy", "transposed-self", lambda g: {
            "self": _transposed((5, 4), torch.float32, g), "dim": 0, "index": _index(5, 2, g, unique=True),
            "source": _values((2, 4), torch.float32, g)}),
    ],
    "index_fill": [
        _parity("index_fill", "transposed-self-int-value", lambda g: {
            "self": _transposed((5, 4), torch.float32, g), "dim": 0, "index": _index(5, 2, g, unique=True),
            "value": 3}),
        _parity("index_fill", "float-self-int-tensor-value", lambda g: {
            "self": _values((5, 4), torch.float32, g), "dim": 1, "index": _index(4, 2, g, unique=True),
            "value": torch.tensor(3)}),
        _parity("index_fill", "float32-self-float64-value", lambda g: {
            "self": _values((5, 4), torch.float32, g), "dim": 1, "index": _index(4, 2, g, unique=True),
            "value": _values((), torch.float64, g).requires_grad_()}, differentiable=("self", "value")),
        _parity("index_fill", "int-self-float-value", lambda g: {
            "self": _values((5, 4), torch.int64, g), "dim": 0, "index": _index(5, 2, g, unique=True),
            "value": 2.7}),
        _parity("index_fill", "bool-self-float-value", lambda g: {
            "self": _values((5, 4), torch.bool, g), "dim": 0, "index": _index(5, 2, g, unique=True),
            "value": 0.5}),
        _parity("index_fill", "edge-indices", lambda g: {
            "self": _values((5, 4), torch.float32, g), "dim": 0, "index": torch.tensor([-5, 4, -1]), "value": 1.5}),
    ],
    "masked_fill": [
        _parity("masked_fill", "transposed-self-int-value", lambda g: {
            "self": _transposed((4, 5), torch.float32, g), "mask": _mask((4, 5), g), "value": 3}),
        _parity("masked_fill", "channels-last-self", lambda g: {
            "self": _channels_last(g), "mask": _mask((2, 3, 4, 5), g), "value": -1.0}),
        _parity("masked_fill", "mask-wider-than-self", lambda g: {
            "self": _values((5,), torch.float32, g), "mask": _mask((4, 5), g), "value": 2.0}),
        _parity("masked_fill", "float32-self-float64-value", lambda g: {
            "self": _values((4, 5), torch.float32, g), "mask": _mask((4, 5), g),
            "value": _values((), torch.float64, g).requires_grad_()}, differentiable=("self", "value")),
        _parity("masked_fill", "int-self-float-tensor-value", lambda g: {
            "self": _values((4, 5), torch.int64, g), "mask": _mask((4, 5), g), "value": torch.tensor(2.7)}),
        _parity("masked_fill", "bool-self-int-value", lambda g: {
            "self": _values((4, 5), torch.bool, g), "mask": _mask((4, 5), g), "value": 2}),
    ],
    "masked_scatter": [
        _parity("masked_scatter", "transposed-self", lambda g: {
            "self": _transposed((4, 5), torch.float32, g), "mask": _mask((4, 5), g),
            "source": _values((20,), torch.float32, g)}),
        _parity("masked_scatter", "mask-wider-than-self", lambda g: {
            "self": _values((5,), torch.float32, g), "mask": _mask((4, 5), g),
            "source": _values((4, 5), torch.float32, g)}),
        _parity("masked_scatter", "source-requires-grad", lambda g: {
            "self": _values((4, 5), torch.float32, g), "mask": _mask((4, 5), g),
            "source": _values((25,), torch.float32, g).requires_grad_()}, differentiable=("source",)),
    ],
    "contiguous": [
        _parity("contiguous", "channels-last-to-contiguous", lambda g: {"self": _channels_last(g)}),
        _parity("contiguous", "already-channels-last", lambda g: {
            "self": _channels_last(g), "memory_format": torch.channels_last}, ("memory_format",)),
        _parity("contiguous", "already-contiguous", lambda g: {"self": _values((3, 4), torch.float32, g)}),
    ],
    "to": [
        _parity("to", "same-dtype-no-copy", lambda g: {
            "self": _values((3, 4), torch.float32, g), "dtype": torch.float32}, ("dtype",)),
        _parity("to", "same-device-preserve", lambda g: {
            "self": _transposed((3, 4), torch.float32, g), "device": torch.device("cpu"),
            "memory_format": torch.preserve_format}, ("device", "memory_format")),
        _parity("to", "transposed-new-dtype", lambda g: {
            "self": _transposed((3, 4), torch.float32, g), "dtype": torch.float64}, ("dtype",)),
        _parity("to", "strided-slice-new-dtype", lambda g: {
            "self": _values((4, 6), torch.float32, g)[:, ::2], "dtype": torch.float64}, ("dtype",)),
        _parity("to", "channels-last-new-dtype", lambda g: {
            "self": _channels_last(g), "dtype": torch.float64}, ("dtype",)),
        _parity("to", "strided-layout", lambda g: {
            "self": _values((3, 4), torch.float32, g), "layout": torch.strided, "dtype": torch.float64},
            ("layout", "dtype")),
        _parity("to", "to-complex", lambda g: {
            "self": _values((3, 4), torch.float32, g), "dtype": torch.complex64}, ("dtype",)),
    ],
}
