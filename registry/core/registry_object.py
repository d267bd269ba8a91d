"""``Registry``: one object that holds what the registry knows and what it has put into PyTorch.

As pluggy's ``PluginManager`` holds its plugins and hooks, one ``Registry`` holds the op table (``table``: the op
definitions, their composites, derivative ops, rules and preferences, and the listeners of changes) and the router
(``router``: the frames ``use()`` pushes, the bounded decision table and its generation, the dispatcher Libraries of
either backend, the compiled module, the patches and the patched attributes), and the router's selector
(``selector``: the decisions of the table, their bounded cache and the evidence slot they read). ``install()`` puts
the routing into PyTorch and ``uninstall()`` takes all of it out again.

``DEFAULT`` is the registry ``import registry`` fills; the module-level names (``define_op``, ``register``, ``use``,
``select``, ``OPS``, ``COMPOSITES``, ...) are its table's and its router's. PyTorch's dispatcher is one per process:
one registry's routing is installed at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from registry.core import evidence, routing, selector
from registry.core.model import Composite, OpDef
from registry.core.registration import TABLE, F, OpTable
from registry.core.routing import ROUTER, Router


class Registry:
    """The op table and its router, as one object (``DEFAULT`` is the one ``import registry`` fills)."""

    def __init__(self, table: OpTable | None = None, router: Router | None = None) -> None:
        self.table = OpTable() if table is None else table
        self.router = Router(self.table) if router is None else router
        if self.router.table is not self.table:
            raise ValueError("Registry: the router routes another op table than the one given")
        self.selector = self.router.selector  # the decisions of this table, their cache and evidence

    @property
    def evidence(self) -> evidence.EvidenceSlot:
        return self.selector.evidence

    def register_source(self, source: evidence.EvidenceSource) -> None:
        """Make ``source`` the evidence this registry's later decisions read (its cached ones are dropped)."""
        self.selector.evidence.register(source)

    # --- the op table -------------------------------------------------------------------------------------------

    # The tables are handed out loaded: the built-in families and the plugins are imported on the first read.

    @property
    def ops(self) -> dict[str, Any]:
        self.table.load()
        return self.table.ops

    @property
    def composites(self) -> dict[str, dict[str, Composite]]:
        self.table.load()
        return self.table.composites

    @property
    def derivatives(self) -> dict[str, dict[str, Callable[..., object]]]:
        self.table.load()
        return self.table.derivatives

    def define_op(self, name: str, overload: str = "", **options: Any) -> OpDef:
        """``OpTable.define_op`` on this registry's table."""
        return self.table.define_op(name, overload, **options)

    def register(self, op: str, kind: str, *, name: str | None = None, function: object = None,
                 ) -> Callable[[F], F]:
        return self.table.register(op, kind, name=name, function=function)

    def register_derivative(self, op: str, overload: str) -> Callable[[F], F]:
        return self.table.register_derivative(op, overload)

    def unregister(self, op: str, name: str) -> Composite:
        return self.table.unregister(op, name)

    def load(self) -> None:
        self.table.load()

    # --- routing ------------------------------------------------------------------------------------------------

    def use(self, policy: str = "auto", pins: Mapping[str, str] | None = None, *, record: bool = False,
            ) -> routing.use:
        """``use()`` routed by this registry's router."""
        return routing.use(policy, pins, record=record, router=self.router)

    def select(self, op: str, **context: Any) -> selector.Decision:
        """``select()``: the decision for ``op`` in a described context, and why, from this registry's table."""
        return self.selector.select(op, **context)

    def install(self) -> None:
        """Register every kernel at PyTorch's dispatcher and patch the two Python-level paths (``use()`` does it on
        its first call)."""
        self.router.install()

    def uninstall(self) -> None:
        """Remove every kernel and restore every patched attribute: PyTorch behaves as before the import."""
        self.router.uninstall()

    @property
    def installed(self) -> bool:
        return self.router.installed

    def routing_backend(self) -> str:
        return self.router.routing_backend()

    def set_routing_backend(self, backend: str) -> None:
        self.router.set_routing_backend(backend)

    def clear_cache(self) -> None:
        """Forget every decision (a new generation for the selector's cache and both backends' tables)."""
        self.selector.clear()


DEFAULT = Registry(TABLE, ROUTER)
