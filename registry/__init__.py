"""multicomposite: several decompositions per PyTorch op, and the one that fits the active transform stack.

    with registry.use():
        torch.func.vmap(torch.func.grad(f))(x)

    registry.select("index_fill", stack="vmap,grad").reason

``import registry`` imports no torch: each name below is imported from its module when first asked for (PEP 562), so
that a leaf module of vocabularies (``registry.core.policies``, ``registry.core.status``,
``registry.store.job_states``), which runs this file first, stays light for the command line's ``--help``. The
built-in composite families and the plugins' (entry points) are imported later still, by ``load()``, which every
entry point that needs the ops calls: ``select``, ``use``, ``composites``, ``decomposition_table``, ``check``, and
the ``OPS`` and ``COMPOSITES`` names here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from registry.core import evidence as _evidence

if TYPE_CHECKING:
    from registry.core.context import Context, current_stack
    from registry.core.decompositions import decomposition_table
    from registry.core.kinds import KINDS
    from registry.core.model import Composite, Op
    from registry.core.ops import OPS
    from registry.core.policies import POLICIES
    from registry.core.registration import COMPOSITES, RegistrationError, load, register, unregister
    from registry.core.registry_object import DEFAULT, Registry
    from registry.core.routing import register_kernels, routing_active, routing_backend, use
    from registry.core.selector import Decision, SelectionError, Verdict, clear_cache, select
    from registry.core.stacks import format_stack, parse_stack
    from registry.harness.check import CheckError, CheckReport, check
    from registry.store.evidence import StoreStatus

    __version__: str  # read from the package's metadata when first asked for

# name -> the module that defines it, imported on first access.
_LAZY: dict[str, str] = {
    "Context": "registry.core.context",
    "current_stack": "registry.core.context",
    "decomposition_table": "registry.core.decompositions",
    "KINDS": "registry.core.kinds",
    "Composite": "registry.core.model",
    "Op": "registry.core.model",
    "OPS": "registry.core.ops",
    "COMPOSITES": "registry.core.registration",
    "RegistrationError": "registry.core.registration",
    "load": "registry.core.registration",
    "register": "registry.core.registration",
    "unregister": "registry.core.registration",
    "DEFAULT": "registry.core.registry_object",
    "Registry": "registry.core.registry_object",
    "register_kernels": "registry.core.routing",
    "routing_active": "registry.core.routing",
    "routing_backend": "registry.core.routing",
    "use": "registry.core.routing",
    "POLICIES": "registry.core.policies",
    "Decision": "registry.core.selector",
    "SelectionError": "registry.core.selector",
    "Verdict": "registry.core.selector",
    "clear_cache": "registry.core.selector",
    "select": "registry.core.selector",
    "format_stack": "registry.core.stacks",
    "parse_stack": "registry.core.stacks",
    # The harness, for ``registry.check`` and its report.
    "check": "registry.harness.check",
    "CheckReport": "registry.harness.check",
    "CheckError": "registry.harness.check",
}
# The op tables themselves: filled by ``load()``, so they are handed out loaded.
_LOADED = frozenset({"OPS", "COMPOSITES"})


def _version() -> str:
    # importlib.metadata costs more than the rest of this file: read only when asked for.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("multicomposite")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> object:
    if name == "__version__":
        value: object = _version()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'registry' has no attribute {name!r}")
    if name in _LOADED:
        from registry.core.registration import load as load_ops

        load_ops()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # asked for once: later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _store_source() -> _evidence.EvidenceSource:
    from registry.store import evidence as store_evidence

    return store_evidence.SOURCE


# The store's evidence reaches the selector through the source the core reads (policy ``auto``): it is the default,
# made (and the store's modules imported) when a decision first asks for evidence. Nothing is read (and no
# SQLAlchemy imported) until a decision needs evidence and a store exists.
_evidence.register_default(_store_source)


def install() -> None:
    """Register the routing at PyTorch's dispatcher and patch its two Python-level paths (the first ``use()`` does)."""
    from registry.core.registry_object import DEFAULT

    DEFAULT.install()


def uninstall() -> None:
    """Take the routing out of PyTorch again: every kernel removed, every patched attribute restored."""
    from registry.core.registry_object import DEFAULT

    DEFAULT.uninstall()


def composites(op: str) -> dict[str, Composite]:
    """The registered composites of ``op``, by name."""
    from registry.core.ops import OPS
    from registry.core.registration import COMPOSITES, load
    from registry.core.selector import SelectionError, unknown_op_message

    load()
    if op not in OPS:
        raise SelectionError(unknown_op_message(op))
    return dict(COMPOSITES[op])


def store_status() -> StoreStatus:
    """Which store ``use()`` reads its evidence from (``MULTICOMPOSITE_DB``, else the default SQLite file) and
    whether it can read it now; ``str()`` of it says so in one line, with what to do where it cannot."""
    from registry.store import evidence as store_evidence

    return store_evidence.store_status()


__all__ = [
    "COMPOSITES",
    "DEFAULT",
    "KINDS",
    "OPS",
    "POLICIES",
    "CheckError",
    "CheckReport",
    "Composite",
    "Context",
    "Decision",
    "Op",
    "RegistrationError",
    "Registry",
    "SelectionError",
    "Verdict",
    "__version__",
    "check",
    "clear_cache",
    "composites",
    "current_stack",
    "decomposition_table",
    "format_stack",
    "install",
    "load",
    "parse_stack",
    "register",
    "register_kernels",
    "routing_active",
    "routing_backend",
    "select",
    "store_status",
    "uninstall",
    "unregister",
    "use",
]
