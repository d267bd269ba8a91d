"""The operators multicomposite covers: their entry points, tensor parameters and call normalization.

PyTorch's unpatched entry points are captured here, at import, before ``use()`` can patch anything: composites call
them through ``ORIGINAL`` so that a native composite never re-enters the router.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from registry.core.model import Op

_PACKETS = ("index_add", "index_copy", "index_fill", "masked_fill", "masked_scatter", "contiguous", "to")

# ORIGINAL.Tensor.index_fill and ORIGINAL.torch.index_fill are PyTorch's own, whatever use() has patched since.
ORIGINAL = SimpleNamespace(
    Tensor=SimpleNamespace(**{name: getattr(torch.Tensor, name) for name in _PACKETS}),
    torch=SimpleNamespace(**{name: getattr(torch, name) for name in _PACKETS if hasattr(torch, name)}),
)


def schema_params(name: str, overload: str) -> tuple[tuple[str, bool], ...]:
    """(parameter name, keyword-only) of ``aten::name.overload``, without ``out``."""
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        if schema.overload_name == overload:
            return tuple((arg.name, arg.kwarg_only) for arg in schema.arguments if arg.name != "out")
    known = sorted(s.overload_name or "<default>" for s in torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
    raise ValueError(f"aten::{name} has no overload {overload!r}; it has {known}")


def _default_normalizer(params: tuple[str, ...], dim_param: str | None):
    """Pass the call through as the composite's (args, kwargs); None for what only PyTorch itself handles."""
    n_params = len(params)
    allowed = frozenset(params)
    dim_position = params.index(dim_param) if dim_param is not None else n_params

    def normalize(args: tuple[Any, ...], kwargs: dict[str, Any]):
        if kwargs:
            if "input" in kwargs:  # torch.index_fill(input=...) names self "input"
                kwargs = dict(kwargs)
                kwargs["self"] = kwargs.pop("input")
            if not allowed.issuperset(kwargs):  # out=, or a typo PyTorch should report in its own words
                return None
        if len(args) > n_params:
            return None
        if dim_param is not None:
            dim = args[dim_position] if len(args) > dim_position else kwargs.get(dim_param)
            if dim.__class__ is str:  # a named dimension: the Dimname overloads stay PyTorch's
                return None
        return args, kwargs

    return normalize


def _normalize_to(args: tuple[Any, ...], kwargs: dict[str, Any]):
    """Fold every ``Tensor.to`` overload into the keyword form ``to.dtype_layout``.

    Plain Python (no ``_parse_to``) so that Dynamo can trace it under ``torch.compile``.
    """
    if not args or kwargs.get("layout") is not None or kwargs.get("pin_memory"):
        return None
    self, rest = args[0], args[1:]
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    non_blocking, copy = kwargs.get("non_blocking", False), kwargs.get("copy", False)
    if not set(kwargs) <= {"dtype", "device", "non_blocking", "copy", "memory_format", "layout", "pin_memory"}:
        return None
    flags = []
    for arg in rest:
        if isinstance(arg, bool):  # positional non_blocking, then copy
            flags.append(arg)
        elif flags:
            return None
        elif isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, torch.Tensor):  # to(other)
            device, dtype = arg.device, arg.dtype
        elif isinstance(arg, (str, torch.device, int)):
            device = arg
        else:
            return None
    if len(flags) > 2:
        return None
    if flags:
        non_blocking = flags[0]
        copy = flags[1] if len(flags) > 1 else copy
    return (self,), {
        "dtype": dtype,
        "device": None if device is None else torch.device(device),
        "non_blocking": non_blocking,
        "copy": copy,
        "memory_format": kwargs.get("memory_format"),
    }


def define(
    name: str,
    overload: str,
    tensor_args: tuple[str, ...],
    doc: str,
    *,
    dim_param: str | None = None,
    normalize=None,
) -> Op:
    params = tuple(param for param, _ in schema_params(name, overload))
    entry_points: list[tuple[Any, str]] = [(torch.Tensor, name)]
    if hasattr(torch, name):
        entry_points.append((torch, name))
    if hasattr(torch.nn.functional, name):
        entry_points.append((torch.nn.functional, name))
    return Op(
        name=name,
        overload=overload,
        entry_points=tuple(entry_points),
        tensor_args=tensor_args,
        doc=doc,
        normalize=normalize or _default_normalizer(params, dim_param),
        params=params,
    )


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        define("index_add", "", ("self", "index", "source"), "self with alpha * source added at index along dim",
               dim_param="dim"),
        define("index_copy", "", ("self", "index", "source"), "self with source copied to index along dim",
               dim_param="dim"),
        define("index_fill", "int_Tensor", ("self", "index", "value"), "self with value written at index along dim",
               dim_param="dim"),
        define("masked_fill", "Tensor", ("self", "mask", "value"), "self with value where mask is True"),
        define("masked_scatter", "", ("self", "mask", "source"),
               "self with source's elements, in order, where mask is True"),
        define("contiguous", "", ("self",), "self laid out in memory_format, self itself when it already is"),
        define("to", "dtype_layout", ("self",), "self converted to dtype, device and memory_format",
               normalize=_normalize_to),
    )
}
