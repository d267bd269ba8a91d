"""Sample inputs for every covered op: the overloads and corner cases each composite must agree with PyTorch on.

A sample is a factory: called with a seed it returns fresh arguments of the same shapes, so a batch is built by
calling it once per sample and stacking the tensors that the batching pattern batches.
"""

from __future__ import annotations

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
