"""The data model: operators and their composites (the kinds a composite can be are ``registry.core.kinds``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# A composite's kind is a name in ``registry.core.kinds.KIND``, the table of kinds (what each one means and does).


class RegistrationError(TypeError):
    """A composite does not fit its op's schema, its kind's spec, or collides with an earlier registration."""


def def_line(fn: Callable[..., object]) -> str:
    """``def name(signature)`` of ``fn``, as an error quotes it."""
    try:
        return f"def {fn.__name__}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return f"def {getattr(fn, '__name__', fn)}(...)"


# An entry point is (owner, attribute): ``(torch, "index_fill")`` or ``(torch.Tensor, "index_fill")``. Entry points
# are documentation (``/ops`` lists them): calls are routed at the dispatcher, whichever entry point made them.
EntryPoint = tuple[Any, str]
# Turns the arguments a dispatcher kernel received for one aten overload into the composite's (args, kwargs), in the
# parameters of the op's own overload.
Adapter = Callable[[tuple[Any, ...], dict[str, Any]], "tuple[tuple[Any, ...], dict[str, Any]]"]


@dataclass(frozen=True)
class Overload:
    """One aten overload that routes to an op's composites: ``aten::index_fill_.int_Scalar``, say."""

    name: str  # "index_fill_.int_Scalar": the packet, then the overload name after the dot
    inplace: bool  # the composite computes the result, which is then copied into ``self``
    adapt: Adapter | None = None  # None: the overload's parameters are the op's own, in the same order

    @property
    def qualified_name(self) -> str:
        return f"aten::{self.name}"

    @property
    def op_overload(self) -> Any:
        """The ``torch.ops.aten`` OpOverload object."""
        packet, _, overload = self.name.partition(".")
        return getattr(getattr(torch.ops.aten, packet), overload or "default")


@dataclass(frozen=True)
class Op:
    """An ATen operator packet (``index_fill``) and the Python entry points that reach it."""

    name: str
    overload: str  # the schema overload whose parameter names every composite must use
    entry_points: tuple[EntryPoint, ...]
    tensor_args: tuple[str, ...]  # schema names of the tensor parameters, ``self`` first
    doc: str
    params: tuple[str, ...] = field(default=())  # filled in from the schema by ``ops.define``
    # The parameters of ``tensor_args`` that are a Tensor[] in the schema (lstm_cell's hx): a call's context holds the
    # list's first tensor under the parameter's name. Filled in by ``ops.define``.
    tensor_lists: tuple[str, ...] = field(default=())
    # Every aten overload routed to the composites, in-place variants included.
    overloads: tuple[Overload, ...] = field(default=())
    # Overloads whose derivative formula PyTorch gets wrong in eager autograd too (no transform): these also get a
    # kernel at the Autograd key, which routes them while autograd records.
    eager_autograd: tuple[str, ...] = field(default=())
    # The op_db entries (``name`` or ``name.variant``) whose OpInfo samples exercise this op: where its test, verify
    # and survey cases come from when it has no hand-written samples (``registry.harness.samples``).
    opinfo: tuple[str, ...] = field(default=())
    family: str = ""  # the composites module that defines it: ``composites.index``

    @property
    def qualified_entry_points(self) -> tuple[str, ...]:
        return tuple(f"{_owner_name(owner)}.{attr}" for owner, attr in self.entry_points)


@dataclass(frozen=True)
class OpDef(Op):
    """An ``Op`` as ``define_op`` made it: what the registry knows of it next to it, as ``CustomOpDef`` is for
    ``torch.library.custom_op``. ``rules`` (kind -> where that kind fails) and ``preference`` (the op's own order of
    kinds) are the selector's; ``samples`` are its seed samples where ``define_op`` was given some (a callable of a
    ``torch.Generator`` returning argument tuples; the harness reads them before its own tables)."""

    rules: Mapping[str, Any] = field(default_factory=dict, compare=False)
    preference: Callable[..., Any] | None = field(default=None, compare=False)
    samples: Callable[..., Any] | None = field(default=None, compare=False)
    # The table that holds this op (``registration.OpTable``): where ``register`` puts its composites.
    table: Any = field(default=None, compare=False, repr=False)

    def register(self, kind: str, *, name: str | None = None, function: type | None = None,
                 ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """``register(self.name, kind, ...)`` on the table holding this op: ``@index_fill.register("functional")``."""
        return self.table.register(self.name, kind, name=name, function=function)


@dataclass(frozen=True)
class Composite:
    """One way to compute an op: a small function plus what the selector needs to know about it."""

    op: str
    name: str
    kind: str  # a name in registry.core.kinds.KIND
    fn: Callable[..., Any]
    doc: str
    where: str  # "file:line" of the registration, for duplicate errors and the API
    # A cpp_op composite that is its C++ op applied to the call's own arguments: the name of that op
    # ("multicomposite::linear"), which the C++ routing calls without entering Python (register(..., redirect=)).
    redirect: str | None = None

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
