"""The data model: operators, their composites, and the kinds a composite can be."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["native", "mutating", "functional", "primitive"]
KINDS: tuple[Kind, ...] = ("native", "mutating", "functional", "primitive")

KIND_DOCS: dict[str, str] = {
    "native": "PyTorch's own op, always present",
    "mutating": "clone, then the in-place op",
    "functional": "out-of-place ops only",
    "primitive": "a torch.autograd.Function with its own backward, jvp and vmap rules",
}

# An entry point is (owner, attribute): ``(torch, "index_fill")`` or ``(torch.Tensor, "index_fill")``.
EntryPoint = tuple[Any, str]
# Turns the arguments an entry point received into the composite's (args, kwargs), or None when this call must go
# straight to PyTorch (an ``out=`` tensor, a named dimension, an overload the composites do not model).
Normalizer = Callable[[tuple[Any, ...], dict[str, Any]], "tuple[tuple[Any, ...], dict[str, Any]] | None"]


@dataclass(frozen=True)
class Op:
    """An ATen operator packet (``index_fill``) and the Python entry points that reach it."""

    name: str
    overload: str  # the schema overload whose parameter names every composite must use
    entry_points: tuple[EntryPoint, ...]
    tensor_args: tuple[str, ...]  # schema names of the tensor parameters, ``self`` first
    doc: str
    normalize: Normalizer | None = None
    params: tuple[str, ...] = field(default=())  # filled in from the schema by ``ops.define``

    @property
    def qualified_entry_points(self) -> tuple[str, ...]:
        return tuple(f"{_owner_name(owner)}.{attr}" for owner, attr in self.entry_points)


@dataclass(frozen=True)
class Composite:
    """One way to compute an op: a small function plus what the selector needs to know about it."""

    op: str
    name: str
    kind: Kind
    fn: Callable[..., Any]
    doc: str
    where: str  # "file:line" of the registration, for duplicate errors and the API

    @property
    def source(self) -> str:
        try:
            return inspect.getsource(self.fn)
        except (OSError, TypeError):
            return ""


def _owner_name(owner: Any) -> str:
    if owner.__name__ == "Tensor":
        return "torch.Tensor"
    return owner.__name__
