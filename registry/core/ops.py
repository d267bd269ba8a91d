"""The operators multicomposite covers: their aten overloads, tensor parameters and entry points.

``use()`` routes every overload listed here at PyTorch's dispatcher. ``ORIGINAL`` keeps PyTorch's own Python entry
points as captured at import: ``Tensor.contiguous`` is the one entry point ``use()`` wraps at the Python level (it
fails inside C++ under vmap before any dispatch), and references outside any transform call these.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from registry.core.model import Op, Overload

_PACKETS = ("index_add", "index_copy", "index_fill", "masked_fill", "masked_scatter", "contiguous", "to")

# ORIGINAL.Tensor.contiguous is PyTorch's own, captured before use() wraps it (the one Python-level path).
ORIGINAL = SimpleNamespace(
    Tensor=SimpleNamespace(**{name: getattr(torch.Tensor, name) for name in _PACKETS}),
    torch=SimpleNamespace(**{name: getattr(torch, name) for name in _PACKETS if hasattr(torch, name)}),
)


def schema_params(name: str, overload: str) -> tuple[tuple[str, bool], ...]:
    """(parameter name, keyword-only) of ``aten::name.overload``, without ``out``."""
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        if schema.overload_name == overload:
            return tuple((arg.name, arg.kwarg_only) for arg in schema.arguments if not arg.is_out)
    known = sorted(s.overload_name or "<default>" for s in torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
    raise ValueError(f"aten::{name} has no overload {overload!r}; it has {known}")


def _tensor_list_params(name: str, overload: str) -> frozenset[str]:
    """The parameters of ``aten::name.overload`` that take a list of tensors (``Tensor[]``)."""
    return frozenset(arg.name for arg in aten_schema(f"{name}.{overload}" if overload else name).arguments
                     if isinstance(arg.type, torch.ListType) and arg.type.getElementType().isSubtypeOf(
                         torch.TensorType.get()))


def _to_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``to.device(self, device, dtype, non_blocking=False, copy=False, memory_format=None)``."""
    return _to_keywords(args[0], ("device", "dtype", "non_blocking", "copy", "memory_format"), args[1:], kwargs)


def _to_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``to.dtype(self, dtype, non_blocking=False, copy=False, memory_format=None)``."""
    return _to_keywords(args[0], ("dtype", "non_blocking", "copy", "memory_format"), args[1:], kwargs)


def _to_other(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``to.other(self, other, non_blocking=False, copy=False, memory_format=None)``: other's dtype and device."""
    self, other, *rest = args
    call = _to_keywords(self, ("non_blocking", "copy", "memory_format"), tuple(rest), kwargs)
    call[1].update(dtype=other.dtype, device=other.device)
    return call


def _to_keywords(self: Any, names: tuple[str, ...], positional: tuple[Any, ...], kwargs: dict[str, Any]):
    """The keyword form of ``to.dtype_layout``, which every composite of ``to`` takes."""
    keywords = dict(zip(names, positional, strict=False))
    keywords.update(kwargs)
    return (self,), keywords


# What translates each ``to`` overload's arguments into ``to.dtype_layout``'s keywords.
TO_ADAPTERS: dict[str, Any] = {"to.device": _to_device, "to.dtype": _to_dtype, "to.other": _to_other}


def aten_schema(overload: str) -> Any:
    """The schema of an aten overload named ``packet.overload``, ``packet`` (the default one) or ``aten::...``."""
    packet, _, name = overload.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, packet), name or "default")._schema


def overloads(name: str, *extra: str, adapters: dict[str, Any] | None = None, inplace: bool = True,
               only: tuple[str, ...] | None = None) -> tuple[Overload, ...]:
    """The functional and in-place overloads of ``name`` whose parameters are the composites' own.

    ``extra`` names more overloads (``to.dtype``) and ``adapters`` maps an overload to what translates its arguments;
    ``inplace=False`` leaves the in-place variants to PyTorch (``fill_`` is every factory's building block); ``only``
    keeps just the named overloads (``take``, ``narrow.Tensor``). ``out=`` and Dimname overloads are left to PyTorch:
    functorch cannot batch into an ``out`` tensor, and named tensors do not work under functorch transforms.
    """
    found = []
    for packet in (name, f"{name}_") if inplace else (name,):
        for schema in torch._C._jit_get_schemas_for_operator(f"aten::{packet}"):
            overload = schema.overload_name
            if overload == "out" or overload.endswith("_out") or "imname" in overload:
                continue
            found.append(f"{packet}.{overload}" if overload else packet)
    adapters = adapters or {}
    found += [overload for overload in extra if overload not in found]
    if only is not None:
        missing = [o for o in only if o not in found]
        if missing:
            raise ValueError(f"aten::{name} has no overload {', '.join(missing)}; it has {', '.join(found)}")
        found = [o for o in found if o in only]
    return tuple(
        Overload(name=overload, inplace=overload.partition(".")[0].endswith("_"), adapt=adapters.get(overload))
        for overload in found
        if not overload.startswith("to.prim")  # TorchScript's own overloads: never reached from Python or ATen
    )


# Python namespaces whose functions reach an aten op, and the prefix aten puts before their names.
_NAMESPACES: tuple[tuple[Any, str], ...] = (
    (torch.Tensor, ""), (torch, ""), (torch.nn.functional, ""), (torch.special, "special_"),
    (torch.linalg, "linalg_"), (torch.fft, "fft_"),
)


def _entry_points(name: str) -> tuple[tuple[Any, str], ...]:
    found = []
    for owner, prefix in _NAMESPACES:
        if name.startswith(prefix) and hasattr(owner, name.removeprefix(prefix)):
            found.append((owner, name.removeprefix(prefix)))
    return tuple(found)


def define(
    name: str,
    overload: str,
    tensor_args: tuple[str, ...],
    doc: str,
    *,
    overloads: tuple[Overload, ...],
    eager_autograd: tuple[str, ...] = (),
    opinfo: tuple[str, ...] = (),
    family: str = "",
) -> Op:
    """An ``Op`` for ``aten::name.overload``: its parameters from the schema, its entry points from where PyTorch
    exposes the name (``torch.Tensor``, ``torch``, ``torch.nn.functional``, ``torch.special``, ...)."""
    params = tuple(param for param, _ in schema_params(name, overload))
    unknown = [t for t in tensor_args if t not in params]
    if unknown:
        raise ValueError(f"aten::{name}.{overload or 'default'} has no parameter {', '.join(unknown)}; "
                         f"it takes {', '.join(params)}")
    return Op(
        name=name,
        overload=overload,
        entry_points=_entry_points(name),
        tensor_args=tensor_args,
        doc=doc,
        params=params,
        tensor_lists=tuple(t for t in tensor_args if t in _tensor_list_params(name, overload)),
        overloads=overloads,
        eager_autograd=eager_autograd,
        opinfo=opinfo,
        family=family,
    )


# Every covered op, by name, in definition order: filled by ``registry.core.registration.define_op`` as the
# composites modules (``composites.index``, ...) are imported; ``import registry`` imports them all.
OPS: dict[str, Op] = {}
