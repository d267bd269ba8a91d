"""The kinds of composite, as one table: each ``Kind`` says everything the registry does differently for it.

A kind is an entry, not a string tested in many places (as functorch's ``custom_function_call.py_impl(TransformType.X)``
is one entry per transform): its rule as a kind (where a composite of that kind fails, whatever the op), its place in
the general preference order outside and under vmap, how a decision for it runs in the routing kernel (PyTorch's own
kernel, or the composite), whether it can stand in a decomposition table, how ``define_op(generate=...)`` makes one
from the schema, and what ``register`` checks of it. Adding a kind is adding one entry to ``KIND``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from registry.core.context import Context
from registry.core.model import Op, RegistrationError, def_line
from registry.core.ops import aten_schema


@dataclass(frozen=True)
class Problem:
    status: str  # slow | error | mismatch
    evidence: str


Rule = Callable[[Context], "Problem | None"]


def under_vmap(ctx: Context) -> bool:
    # Under torch.compile the functorch stack inside the graph is invisible: assume a vmap may be there.
    return "vmap" in ctx.stack or "compile" in ctx.stack


# What ``register`` checks of a composite of a kind beyond its signature: (op, fn, function=..., "file:line").
Check = Callable[[str, Callable[..., object], Any, str], None]


@dataclass(frozen=True)
class Kind:
    """One kind of composite."""

    name: str
    doc: str
    # Where every composite of this kind fails as such (checked before the op's own rules); None: nowhere known.
    rule: Rule | None
    rank: int  # its place in the general order of preference outside vmap (lowest first)
    rank_under_vmap: int  # ... and under vmap (and torch.compile, whose graph may hold one)
    # How a decision for it runs in the routing kernel, per overload: (out of place, in place) -> whether PyTorch's
    # own kernel runs (else the composite does, an in-place overload's out of place and copied into self).
    runs_native: tuple[bool, bool] = (False, False)
    # Whether a decomposition table (a flat graph below every transform) may hold it: a primitive's vmap and jvp
    # rules have nothing to apply to there, and its fused bodies would run while the graph is traced.
    traceable: bool = True
    # How ``define_op(generate=(name,))`` makes one from the op's schema; None: it is written by hand.
    generate: Callable[[Op], Callable[..., object]] | None = None
    check: Check | None = None  # what ``register`` checks of it beyond the signature
    needs_function: str = ""  # what ``register(..., function=...)`` must name, where it needs one


# --- the rules of the kinds as such -------------------------------------------------------------------------------


def mutating_rule(ctx: Context) -> Problem | None:
    if under_vmap(ctx):
        if not ctx.self_covers_batching:
            return Problem("error", "an in-place op cannot write a batched argument into an unbatched clone of self")
        return Problem("error", "in-place ops under vmap raise or fall back to vmap's per-sample loop "
                                "(measured under vmap, vmap(grad), vmap(jacfwd) and hessian)")
    return None


def primitive_rule(ctx: Context) -> Problem | None:
    if "functionalize" in ctx.stack:
        return Problem("error", "functionalize has no rule for torch.autograd.Function (NYI: custom_function_call)")
    if "compile" in ctx.stack:
        return Problem("error", "Dynamo does not trace a torch.autograd.Function with a custom jvp under torch.func "
                                "transforms (measured: masked_scatter under compile(grad))")
    return None


def functional_rule(ctx: Context) -> Problem | None:
    return None


def custom_op_rule(ctx: Context) -> Problem | None:
    # torch.library.custom_op's registered autograd is an autograd.Function without setup_context, which functorch
    # refuses: under grad or jvp, and wherever autograd records under another transform.
    transformed = any(transform in ctx.stack for transform in ("vmap", "functionalize", "compile"))
    if "grad" in ctx.stack or "jvp" in ctx.stack or ("autograd" in ctx.stack and transformed):
        return Problem("error", "torch.func refuses a torch.library.custom_op's registered autograd on torch 2.13 "
                                "(an autograd.Function without setup_context): grad, jvp, jacrev, jacfwd and hessian "
                                "raise, and so does a transform that autograd records through")
    return None


def cpp_op_rule(ctx: Context) -> Problem | None:
    # Imported here: the kernels' module is only needed where a cpp_op composite is judged.
    from registry.core import kernels

    if "compile" in ctx.stack:
        return Problem("error", "the C++ ops have no fake-tensor kernel verified under torch.compile")
    if not kernels.fused_ops_available():
        return Problem("error", "the C++ ops are not built in this process (they compile with the routing kernels: "
                                f"{kernels.HOW_TO})")
    return None


# --- how the mechanical kinds are made from the schema ------------------------------------------------------------


def schema_signature(op: Op) -> inspect.Signature:
    """The Python signature of ``op``'s schema: positional parameters, then keyword-only ones, with defaults."""
    schema = aten_schema(f"{op.name}.{op.overload}" if op.overload else op.name)
    parameters = []
    for arg in schema.arguments:
        if arg.is_out:
            continue
        kind = inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = inspect.Parameter.empty if not arg.has_default_value() else arg.default_value
        parameters.append(inspect.Parameter(arg.name, kind, default=default))
    return inspect.Signature(parameters)


def generated_native(op: Op) -> Callable[..., object]:
    # The packet, not the one overload: it resolves a Python scalar value to a Scalar overload as PyTorch does.
    packet = getattr(torch.ops.aten, op.name)
    signature = schema_signature(op)

    def native(*args: object, **kwargs: object) -> object:
        return packet(*args, **kwargs)

    native.__signature__ = signature  # type: ignore[attr-defined]
    native.__doc__ = f"PyTorch's own {op.name} (aten::{op.name}{'.' + op.overload if op.overload else ''})."
    native.__name__ = f"{op.name}_native"
    native.__module__ = op.family or __name__
    return native


def generated_mutating(op: Op) -> Callable[..., object]:
    packet = getattr(torch.ops.aten, f"{op.name}_", None)
    overload = getattr(packet, op.overload or "default", None) if packet is not None else None
    if overload is None:
        raise RegistrationError(f"define_op({op.name}): no in-place aten::{op.name}_.{op.overload or 'default'} to "
                                "generate a mutating composite from; write one or drop 'mutating' from generate")
    signature = schema_signature(op)
    first = next(iter(signature.parameters))

    def mutating(*args: object, **kwargs: object) -> object:
        bound = signature.bind(*args, **kwargs)
        bound.arguments[first] = bound.arguments[first].clone()  # type: ignore[union-attr]
        return overload(*bound.args, **bound.kwargs)

    mutating.__signature__ = signature  # type: ignore[attr-defined]
    mutating.__doc__ = f"Clone {first}, then aten::{op.name}_ in place."
    mutating.__name__ = f"{op.name}_mutating"
    mutating.__module__ = op.family or __name__
    return mutating


# --- what register checks -----------------------------------------------------------------------------------------

PRIMITIVE_STATICMETHODS = ("forward", "setup_context", "backward", "jvp", "vmap")


def check_primitive(op_name: str, fn: Callable[..., object], function: Any, where: str) -> None:
    if function is None:
        raise RegistrationError(
            f"{where}: {def_line(fn)} is registered as a primitive of {op_name} without its torch.autograd.Function; "
            "pass it as register(..., function=TheFunction)"
        )
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise RegistrationError(f"{where}: function={function!r} for {op_name} is not a torch.autograd.Function")
    # torch.autograd.Function itself has placeholders for all five: each must be the primitive's own staticmethod.
    own = [klass for klass in function.__mro__ if not klass.__module__.startswith("torch.autograd")]
    missing = [
        name for name in PRIMITIVE_STATICMETHODS
        if not any(isinstance(vars(klass).get(name), staticmethod) for klass in own)
    ]
    if missing:
        raise RegistrationError(
            f"{where}: primitive {function.__name__} for {op_name} lacks the staticmethods {', '.join(missing)}; "
            f"a primitive defines {', '.join(PRIMITIVE_STATICMETHODS)} so that autograd, forward AD and vmap "
            "never decompose it"
        )


# A custom op's registrations, by the attribute of ``CustomOpDef`` that holds each (a custom op always has kernels at
# the Autograd and Meta keys: one that raises without a formula, one that asks for a fake kernel).
CUSTOM_OP_REGISTRATIONS = {"register_autograd": "_backward_fn", "register_vmap": "_vmap_fn",
                           "register_fake": "_abstract_fn"}


def _check_registrations(custom: Any, where: str, op_name: str) -> None:
    missing = [name for name, attribute in CUSTOM_OP_REGISTRATIONS.items() if getattr(custom, attribute) is None]
    if missing:
        raise RegistrationError(
            f"{where}: custom op {custom._qualname} for {op_name} lacks {', '.join(missing)}; a custom_op composite "
            "brings its own backward, vmap rule and fake kernel, so that vmap and torch.compile never decompose it")


class LazyCustomOp:
    """A ``torch.library.custom_op`` made on first use: making one costs about 20 ms, which ``import registry``
    must not pay for every op that has one. ``define()`` makes the op and its registrations (``register_autograd``,
    ``register_vmap``, ``register_fake``) and returns it; ``get()`` calls it once and checks them."""

    def __init__(self, qualified: str, define: Callable[[], Any], *, op: str = "", where: str = "") -> None:
        self.qualified = qualified  # "multicomposite::special_log_ndtr"
        self.define = define
        self.op = op
        self.where = where
        self._made: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        made = self._made
        if made is None:
            with self._lock:
                if self._made is None:
                    custom = self.define()
                    _check_registrations(custom, self.where or "custom_op", self.op or self.qualified)
                    self._made = custom
                made = self._made
        return made


def check_custom_op(op_name: str, fn: Callable[..., object], function: Any, where: str) -> None:
    if isinstance(function, LazyCustomOp):
        return  # checked when it is made, on first use
    if not isinstance(function, torch._library.custom_ops.CustomOpDef):
        raise RegistrationError(
            f"{where}: {def_line(fn)} is registered as a custom_op of {op_name} without its torch.library.custom_op; "
            "pass it as register(..., function=the_custom_op) or a LazyCustomOp that makes it"
        )
    _check_registrations(function, where, op_name)


# --- the table ----------------------------------------------------------------------------------------------------

NATIVE = Kind("native", "PyTorch's own op, always present", rule=None, rank=0, rank_under_vmap=0,
              runs_native=(True, False), generate=generated_native)
MUTATING = Kind("mutating", "clone, then the in-place op", rule=mutating_rule, rank=1, rank_under_vmap=4,
                runs_native=(False, True), generate=generated_mutating)
FUNCTIONAL = Kind("functional", "out-of-place ops only", rule=functional_rule, rank=2, rank_under_vmap=1)
PRIMITIVE = Kind("primitive", "a torch.autograd.Function with its own backward, jvp and vmap rules",
                 rule=primitive_rule, rank=3, rank_under_vmap=2, traceable=False, check=check_primitive,
                 needs_function="torch.autograd.Function")
CUSTOM_OP = Kind("custom_op", "a torch.library.custom_op with its own autograd, vmap and fake registrations",
                 rule=custom_op_rule, rank=4, rank_under_vmap=3, check=check_custom_op,
                 needs_function="torch.library.custom_op")

# Last in both orders: where no profile ranks it, a composite of this kind is chosen only where nothing else is valid.
CPP_OP = Kind("cpp_op", "an op of our own in C++ (registry/core/kernels/fused_ops.cpp) with its forward, autograd, "
              "forward-AD and batching kernels in C++", rule=cpp_op_rule, rank=5, rank_under_vmap=5, traceable=False)

KIND: dict[str, Kind] = {kind.name: kind
                         for kind in (NATIVE, MUTATING, FUNCTIONAL, PRIMITIVE, CUSTOM_OP, CPP_OP)}
KINDS: tuple[str, ...] = tuple(KIND)
KIND_DOCS: dict[str, str] = {kind.name: kind.doc for kind in KIND.values()}
GENERATED: tuple[str, ...] = tuple(name for name, kind in KIND.items() if kind.generate is not None)


def order(vmapped: bool) -> tuple[str, ...]:
    """The general order of preference of the kinds, outside vmap or under it."""
    return tuple(sorted(KIND, key=lambda name: KIND[name].rank_under_vmap if vmapped else KIND[name].rank))


def runs_native(kind: str, inplace: bool) -> bool:
    """Whether a decision of ``kind`` runs PyTorch's own kernel for an overload (in place or not)."""
    return KIND[kind].runs_native[inplace]
