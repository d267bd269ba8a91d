"""Registering composites: the ``register`` decorator, its checks, and loading built-in and third-party composites."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import TypeVar

from registry.core import cost, kinds
from registry.core import rules as rule_tables
from registry.core.collector import collection_paused
from registry.core.kinds import KIND, KINDS
from registry.core.model import Composite, Op, OpDef, Overload, RegistrationError, def_line
from registry.core.ops import OPS, define, schema_params
from registry.core.ops import overloads as ops_overloads

F = TypeVar("F", bound=Callable[..., object])

ENTRY_POINT_GROUP = "multicomposite.composites"
PRIMITIVE_STATICMETHODS = kinds.PRIMITIVE_STATICMETHODS

def _where(fn: Callable[..., object]) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return "<unknown>"
    return f"{code.co_filename}:{code.co_firstlineno}"


def _check_signature(op: Op, fn: Callable[..., object], where: str) -> None:
    op_name = op.name
    expected = schema_params(op_name, op.overload)
    parameters = list(inspect.signature(fn).parameters.values())
    got = tuple((p.name, p.kind is inspect.Parameter.KEYWORD_ONLY) for p in parameters)
    if got != expected:
        wanted = ", ".join(("*, " if kw and not any(k for _, k in expected[:i]) else "") + name
                           for i, (name, kw) in enumerate(expected))
        overload = f"aten::{op_name}.{op.overload}" if op.overload else f"aten::{op_name}"
        raise RegistrationError(
            f"{where}: {def_line(fn)} does not match the schema of {overload}; "
            f"a composite of {op_name} takes ({wanted})"
        )


# Modules whose frames are the registry's own, not the caller of ``define_op``.
_OWN_MODULES = frozenset({__name__, "registry.core.registry_object"})


def _caller() -> tuple[str, str]:
    """(module name, "file:line") of the ``define_op`` call: the first frame outside the registry's own modules."""
    caller = inspect.currentframe()
    while caller is not None and caller.f_globals.get("__name__") in _OWN_MODULES:
        caller = caller.f_back
    if caller is None:
        return "", "<unknown>"
    return caller.f_globals.get("__name__", ""), f"{caller.f_code.co_filename}:{caller.f_lineno}"


class OpTable:
    """The ops a registry covers and everything registered for them, in one place (``Registry.table``).

    What used to be parallel module dicts filled in lockstep is one object: the op definitions (``ops``: name ->
    ``OpDef``, whose ``rules`` and ``preference`` are ``op_rules[name]`` and ``op_preferences[name]``), their
    composites, their derivative ops' functional forms, their size signatures (``signatures``), and the listeners
    told of every change (the selector drops its cache). The module-level names (``OPS``, ``COMPOSITES``,
    ``DERIVATIVES``, ``define_op``, ``register``, ...) are the default table's.
    """

    def __init__(self, *, ops: dict[str, Op] | None = None, op_rules: dict[str, dict[str, rule_tables.Rule]] | None
                 = None, op_preferences: dict[str, Callable[[rule_tables.Context], rule_tables.Order | None]] | None
                 = None, builtins: tuple[str, ...] = ()) -> None:
        self.ops: dict[str, Op] = {} if ops is None else ops  # name -> OpDef, in definition order
        # op name -> composite name -> Composite, in registration order.
        self.composites: dict[str, dict[str, Composite]] = {}
        # op -> aten overload of one of its derivative ops (``masked_scatter_backward``, which autograd calls for the
        # native op's gradient) -> a functional form of it: routed under vmap, where PyTorch's kernel has no batching
        # rule.
        self.derivatives: dict[str, dict[str, Callable[..., object]]] = {}
        self.op_rules: dict[str, dict[str, rule_tables.Rule]] = {} if op_rules is None else op_rules
        self.op_preferences: dict[str, Callable[[rule_tables.Context], rule_tables.Order | None]] = (
            {} if op_preferences is None else op_preferences)
        self.signatures = cost.Signatures()  # op -> its size signature (``define_op(..., sizes=...)``)
        self.listeners: list[Callable[[], None]] = []  # called after every change to the composites
        # The packages of composites shipped with the registry, imported by ``load()`` before the plugins. Named, not
        # imported: the families build on the core, so the core imports them only when the ops are first needed.
        self.builtins = builtins
        self.loaded = False  # the built-in families and the plugins' entry points imported
        self.loading = False  # ``load()`` is importing them: a call from inside those imports returns at once
        # Reentrant: a family's import that asks for the ops again (``register`` of an op another family defines)
        # runs on the loading thread and must not wait for itself.
        self.load_lock = threading.RLock()

    def changed(self) -> None:
        for listener in self.listeners:
            listener()

    def define_op(
        self,
        name: str,
        overload: str = "",
        *,
        tensors: tuple[str, ...],
        doc: str,
        opinfo: tuple[str, ...] = (),
        rules: Mapping[str, rule_tables.Rule] | None = None,
        overloads: tuple[Overload, ...] | None = None,
        inplace: bool = True,
        eager_autograd: tuple[str, ...] = (),
        generate: tuple[str, ...] = (kinds.NATIVE.name,),
        preference: Callable[[rule_tables.Context], rule_tables.Order | None] | None = None,
        samples: Callable[..., object] | None = None,
        sizes: cost.SizeSignature | None = None,
    ) -> OpDef:
        """Cover ``aten::name.overload``: the one entry an op needs, next to its composites in
        ``composites/<family>.py``; returns its ``OpDef`` (``.register(kind)``, ``.rules``, ``.samples``).

        ``tensors``: the schema names of its tensor parameters, ``self`` first. ``opinfo``: the op_db entries whose
        samples test, verify and survey it (ops with hand-written samples in ``registry.harness.samples`` leave it
        empty). ``rules``: what is known of where each kind fails, keyed by kind (``registry.core.rules`` has the
        families). ``overloads``: the aten overloads routed to its composites (default: the functional ones and,
        with ``inplace``, their in-place variants). ``generate``: composites made from the schema where they are
        mechanical: ``native`` (PyTorch's own kernel) and ``mutating`` (clone, then the in-place overload).
        ``preference``: the op's own order of kinds where measurement ranks them otherwise than
        ``rules.preference`` (None: the general one). ``samples``: its seed samples, kept on the ``OpDef``.
        ``sizes``: the op's size signature (``registry.core.cost``): where native is correct and only loops, native
        or a composite is chosen by their measured cost at the call's size bucket.
        """
        if name in self.ops:
            raise RegistrationError(f"define_op: {name} is already defined by "
                                    f"{self.ops[name].family or 'an earlier call'}")
        unknown = sorted(set(generate) - set(kinds.GENERATED))
        if unknown:
            raise RegistrationError(f"define_op({name}): cannot generate {', '.join(unknown)}; only "
                                    f"{' and '.join(kinds.GENERATED)} composites are mechanical")
        family, where = _caller()
        try:
            op = define(name, overload, tensors, doc,
                        overloads=overloads if overloads is not None else ops_overloads(name, inplace=inplace),
                        eager_autograd=eager_autograd, opinfo=opinfo, family=family)
        except ValueError as error:
            raise RegistrationError(f"define_op: {error}") from None
        for kind in rules or {}:
            if kind not in KINDS:
                raise RegistrationError(f"define_op({name}): rules for unknown kind {kind!r}; kinds are "
                                        f"{', '.join(KINDS)}")
        own_rules = dict(rules or {})
        definition = OpDef(**{f.name: getattr(op, f.name) for f in dataclasses.fields(Op)}, rules=own_rules,
                           preference=preference, samples=samples, table=self)
        self.ops[name] = definition
        if sizes is not None:
            self.signatures.declare(name, sizes)
        self.composites[name] = {}
        self.derivatives[name] = {}
        self.op_rules[name] = own_rules
        if preference is not None:
            self.op_preferences[name] = preference
        for kind in kinds.GENERATED:
            make = KIND[kind].generate
            if kind in generate and make is not None:
                self.register(name, kind)(make(definition))
                # Generated from the schema: the define_op entry is where it comes from.
                self.composites[name][kind] = dataclasses.replace(self.composites[name][kind], where=where)
        return definition

    def register(self, op: str, kind: str, *, name: str | None = None, function: object = None,
                 redirect: str | None = None) -> Callable[[F], F]:
        """Declare ``fn`` as a composite of ``op``; returns ``fn`` unchanged.

        ``name`` defaults to the kind and must be unique per op. A ``primitive`` names its
        ``torch.autograd.Function``, a ``custom_op`` its ``torch.library.custom_op`` (``function=``). A ``cpp_op``
        whose ``fn`` only calls its C++ op with the call's own arguments may name that op (``redirect=``,
        "multicomposite::linear"): the C++ routing then calls it without Python where a decision picks it.
        """
        if op not in self.ops:
            self.load()  # the op may be one of the families' that are not imported yet
        if op not in self.ops:
            raise RegistrationError(f"register: unknown op {op!r}; define it first with define_op(...) in its "
                                    "composites module")
        if kind not in KINDS:
            raise RegistrationError(f"register({op}): unknown kind {kind!r}; kinds are {', '.join(KINDS)}")
        definition = self.ops[op]
        composites = self.composites[op]
        check = KIND[kind].check

        def decorator(fn: F) -> F:
            where = _where(fn)
            composite_name = name or kind
            _check_signature(definition, fn, where)
            if check is not None:
                check(op, fn, function, where)
            if redirect is not None and kind != kinds.CPP_OP.name:
                raise RegistrationError(f"{where}: redirect={redirect!r} names a C++ op; only a cpp_op composite "
                                        f"is one, not a {kind}")
            earlier = composites.get(composite_name)
            if earlier is not None:
                raise RegistrationError(
                    f"{where}: composite {op}/{composite_name} is already registered at {earlier.where}; "
                    "give this one another name=..."
                )
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            composites[composite_name] = Composite(
                op=op, name=composite_name, kind=kind, fn=fn, doc=doc[0] if doc else "", where=where,
                redirect=redirect,
            )
            self.changed()
            return fn

        return decorator

    def register_derivative(self, op: str, overload: str) -> Callable[[F], F]:
        """Declare ``fn`` as the functional form of ``aten::<overload>``, a derivative op of ``op``; returns ``fn``.

        ``fn`` takes the overload's own parameters. ``use()`` runs it in place of PyTorch's kernel under vmap, and
        ``decomposition_table()`` lists it wherever ``op`` itself is decomposed.
        """
        if op not in self.ops:
            self.load()
        if op not in self.ops:
            raise RegistrationError(f"register_derivative: unknown op {op!r}; define it first with define_op(...) "
                                    "in its composites module")
        name, _, overload_name = overload.partition(".")
        derivatives = self.derivatives[op]

        def decorator(fn: F) -> F:
            where = _where(fn)
            expected = tuple(param for param, _ in schema_params(name, overload_name))
            got = tuple(inspect.signature(fn).parameters)
            if got != expected:
                raise RegistrationError(
                    f"{where}: {def_line(fn)} does not match the schema of aten::{overload}; "
                    f"it takes ({', '.join(expected)})"
                )
            if overload in derivatives:
                raise RegistrationError(f"{where}: a derivative {overload} of {op} is already registered")
            derivatives[overload] = fn
            return fn

        return decorator

    def unregister(self, op: str, name: str) -> Composite:
        """Remove a composite (tests and plugins replacing one); returns it."""
        self.load()
        composites = self.composites.get(op, {})
        if name not in composites:
            raise KeyError(f"unregister: {op} has no composite {name!r}; it has {', '.join(composites)}")
        removed = composites.pop(name)
        self.changed()
        return removed

    def load(self) -> None:
        """Import the built-in composite families (``builtins``), then every ``multicomposite.composites`` entry
        point, once: ``import registry`` imports neither; the first call that needs the ops (``select``, ``use``,
        ``composites``, ``registry.OPS``, ...) calls this. A failed import is raised and tried again next time."""
        if self.loaded:
            return
        with self.load_lock:
            if self.loaded or self.loading:
                return
            self.loading = True
            try:
                with collection_paused():  # the families' definitions are long-lived objects, no garbage
                    for package in self.builtins:
                        importlib.import_module(package)
                    self.load_plugins()
                self.loaded = True
            finally:
                self.loading = False

    def load_plugins(self) -> list[str]:
        """Import every module named in the ``multicomposite.composites`` entry-point group; returns their names."""
        loaded = []
        for entry_point in entry_points(group=ENTRY_POINT_GROUP):
            entry_point.load()
            loaded.append(entry_point.name)
        self.changed()
        return loaded


# The default table, which ``load()`` fills (``registry.core.registry_object.DEFAULT`` holds it) and the module-level
# names below are: every module and plugin that imports them registers into it. ``composites`` is the package of the
# built-in families.
TABLE = OpTable(ops=OPS, op_rules=rule_tables.OP_RULES, op_preferences=rule_tables.OP_PREFERENCES,
                builtins=("composites",))
COMPOSITES = TABLE.composites
DERIVATIVES = TABLE.derivatives
ON_CHANGE = TABLE.listeners
define_op = TABLE.define_op
register = TABLE.register
register_derivative = TABLE.register_derivative
unregister = TABLE.unregister
load = TABLE.load
load_plugins = TABLE.load_plugins
