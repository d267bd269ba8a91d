"""multicomposite: several decompositions per PyTorch op, and the one that fits the active transform stack.

    with registry.use():
        torch.func.vmap(torch.func.grad(f))(x)

    registry.select("index_fill", stack="vmap,grad").reason
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

from registry.core.context import Context, current_stack
from registry.core.decompositions import decomposition_table
from registry.core.kinds import KINDS
from registry.core.model import Composite, Op
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES, RegistrationError, load, register, unregister
from registry.core.registry_object import DEFAULT, Registry
from registry.core.routing import register_kernels, routing_active, routing_backend, use
from registry.core.selector import POLICIES, Decision, SelectionError, Verdict, clear_cache, select
from registry.core.stacks import format_stack, parse_stack

try:
    __version__ = _distribution_version("multicomposite")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def install() -> None:
    """Register the routing at PyTorch's dispatcher and patch its two Python-level paths (the first ``use()`` does)."""
    DEFAULT.install()


def uninstall() -> None:
    """Take the routing out of PyTorch again: every kernel removed, every patched attribute restored."""
    DEFAULT.uninstall()


def composites(op: str) -> dict[str, Composite]:
    """The registered composites of ``op``, by name."""
    load()
    if op not in OPS:
        from registry.core.selector import unknown_op_message

        raise SelectionError(unknown_op_message(op))
    return dict(COMPOSITES[op])


# The built-in composites modules define the ops (OPS) and their composites: import them now, then the plugins'
# (entry points), so that every import of the registry sees every op. The core never imports composites itself:
# they build on it.
import composites as _builtin_composites  # noqa: E402, F401

load()

# The store's evidence reaches the selector through the source the core reads (policy ``auto``): register it. Nothing
# is read (and no SQLAlchemy imported) until a decision needs evidence and a store exists.
from registry.core import evidence as _evidence  # noqa: E402
from registry.store import evidence as _store_evidence  # noqa: E402

_evidence.register_source(_store_evidence.SOURCE)


def store_status() -> _store_evidence.StoreStatus:
    """Which store ``use()`` reads its evidence from (``MULTICOMPOSITE_DB``, else the default SQLite file) and
    whether it can read it now; ``str()`` of it says so in one line, with what to do where it cannot."""
    return _store_evidence.store_status()


def __getattr__(name: str) -> object:
    """``registry.check`` and its report, loaded when first asked for: ``import registry`` stays without the
    harness."""
    if name in ("check", "CheckReport", "CheckError"):
        from registry.harness import check as check_module

        return getattr(check_module, name)
    raise AttributeError(f"module 'registry' has no attribute {name!r}")


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
