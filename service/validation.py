"""Closed sets for what callers send: dtypes from a fixed table, device types this host has or a profile names,
stacks within the matrix's depth. Checked before anything reaches the selector, whose caches they key.

The dtype table is read from ``vars(torch)``, never ``getattr(torch, name)``: torch resolves unknown attributes
lazily, and ``getattr(torch, "_inductor")`` imports the compiler (a second, 74 MB) inside the event loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from registry.core.stacks import format_stack, parse_bounded_stack, shorten

DTYPES: dict[str, torch.dtype] = {name: value for name, value in vars(torch).items()
                                  if isinstance(value, torch.dtype)}
# Transforms that differentiate: under them, only floating point and complex dtypes have a derivative.
DIFFERENTIATING = ("grad", "jvp", "autograd")
_DEVICE = re.compile(r"^([a-z_]+)(?::(\d{1,3}))?$")


class InputError(ValueError):
    """A value outside its closed set; the message says which values are valid."""


def host_device_types() -> tuple[str, ...]:
    """The device types this host can run on."""
    types = ["cpu"]
    if torch.cuda.is_available():
        types.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        types.append("mps")
    return tuple(types)


def parse_dtype(text: str) -> torch.dtype:
    name = text.removeprefix("torch.")
    dtype = DTYPES.get(name)
    if dtype is None:
        common = "float32, float64, float16, bfloat16, int64, int32, bool, complex64"
        raise InputError(f"unknown dtype {shorten(text)!r}; use a torch dtype name such as {common}")
    return dtype


def parse_device(text: str, allowed: Iterable[str]) -> str:
    """``cuda:0`` -> ``cuda``: the device type, which is what decisions and profiles key on."""
    allowed = tuple(allowed)
    match = _DEVICE.match(text)
    if match is None or match.group(1) not in allowed:
        raise InputError(f"device {shorten(text)!r} is not available here; devices: {', '.join(allowed)} "
                         "(a type, optionally with an index: cuda:0)")
    kind, index = match.group(1), match.group(2)
    if kind == "cuda" and index is not None and torch.cuda.is_available() and int(index) >= torch.cuda.device_count():
        raise InputError(f"device {text!r}: this host has {torch.cuda.device_count()} CUDA devices")
    return kind


def parse_stack_input(text: str) -> tuple[str, ...]:
    try:
        return parse_bounded_stack(text)
    except ValueError as error:
        raise InputError(str(error)) from None


def check_dtype_under_stack(dtype: torch.dtype | None, stack: tuple[str, ...]) -> None:
    if dtype is None or dtype.is_floating_point or dtype.is_complex:
        return
    differentiating = [t for t in stack if t in DIFFERENTIATING]
    if differentiating:
        name = str(dtype).removeprefix("torch.")
        raise InputError(f"dtype {name} has no derivative under {format_stack(stack)}: {differentiating[0]} needs a "
                         "floating point or complex dtype")


# Per-sample shapes (select's ``shapes``): at most MAX_DIMS sizes, each at most MAX_SIZE.
MAX_DIMS = 8
MAX_SIZE = 2**31


def _sizes(text: str) -> list[int] | None:
    """``1x2x16`` -> [1, 2, 16]; "" (a 0-d tensor) -> []; None where a size is not a decimal integer."""
    parts = text.split("x") if text else []
    return [int(part) for part in parts] if all(part.isdecimal() for part in parts) else None


def parse_shapes(text: str | None) -> dict[str, list[int]] | None:
    """``query:1x2x16x16,key:1x2x16x16`` -> {"query": [1, 2, 16, 16], ...}; ``name:`` is a 0-d tensor."""
    if not text:
        return None
    shapes: dict[str, list[int]] = {}
    for part in text.split(","):
        name, colon, sizes = part.strip().partition(":")
        dims = _sizes(sizes) if colon and name else None
        if dims is None:
            raise InputError(f"shapes entry {shorten(part.strip())!r} is not name:AxBxC, e.g. query:1x2x16x16")
        if len(dims) > MAX_DIMS or any(size > MAX_SIZE for size in dims):
            raise InputError(f"shapes entry {shorten(part.strip())!r}: at most {MAX_DIMS} sizes, each at most "
                             f"{MAX_SIZE}")
        shapes[name] = dims
    return shapes
