"""How measured evidence reaches the selector: through a source registered here.

The core measures nothing and stores nothing. Policy ``auto`` (and ``fastest``) asks the registered source for the
worst failing entry of the verified matrix that applies to a context, and for the profiled timings of the
candidates; without a source there is no evidence and the rules decide. ``registry/__init__`` names the store's
source (``registry.store.evidence``) as the default, made on the first decision that asks for evidence; a program may
register its own (``register_source``). This module imports no torch: ``registry/__init__`` imports it at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from registry.core.context import Context


@dataclass(frozen=True)
class Evidence:
    status: str
    text: str  # "native: mismatch 2.0 under vmap, pattern others, float32"


@dataclass(frozen=True)
class Timing:
    composite: str
    score_us: float  # geometric mean of the medians over the batch sizes every timed candidate shares
    bucket: int
    batch_sizes: tuple[int, ...]
    spread: float = 0.0  # the largest IQR/median among those medians: how far the score can be trusted


class EvidenceSource(Protocol):
    """What the selector asks of measured evidence."""

    def evidence(self, op: str, composite: str, ctx: Context,
                 tensor_args: tuple[str, ...]) -> tuple[Evidence | None, int]:
        """(the worst failing entry of ``composite`` that applies to ``ctx``, or None; how many entries apply)."""
        ...

    def timings(self, op: str, ctx: Context, candidates: Iterable[str]) -> dict[str, Timing]:
        """Measured scores of ``candidates`` at the profiled size nearest to ``ctx.numel``."""
        ...


class NoEvidence:
    """The source before one is registered: nothing measured, so the rules decide."""

    def evidence(self, op: str, composite: str, ctx: Context,
                 tensor_args: tuple[str, ...]) -> tuple[Evidence | None, int]:
        return None, 0

    def timings(self, op: str, ctx: Context, candidates: Iterable[str]) -> dict[str, Timing]:
        return {}


class EvidenceSlot:
    """Where one registry's selector reads its evidence: the registered source, and the listeners told when it changes
    (its selector, which drops the decisions made on the old evidence). ``Registry.evidence``; ``SLOT`` is the
    default registry's, which the module-level ``register_source`` and ``source`` use. Where none is registered, the
    ``default`` factory makes one when a decision first asks (the store's source imports the store's modules, which
    ``import registry`` leaves for then)."""

    def __init__(self, source: EvidenceSource | None = None,
                 default: Callable[[], EvidenceSource] = NoEvidence) -> None:
        self.registered: EvidenceSource | None = source
        self.default = default
        self.listeners: list[Callable[[], None]] = []

    @property
    def source(self) -> EvidenceSource:
        if self.registered is None:
            self.registered = self.default()
        return self.registered

    def register(self, source: EvidenceSource) -> None:
        """Make ``source`` the evidence every later decision reads."""
        self.registered = source
        for listener in self.listeners:
            listener()

    def register_default(self, factory: Callable[[], EvidenceSource]) -> None:
        """Make ``factory()`` the source where none is registered, made on the first decision that asks."""
        self.default = factory


SLOT = EvidenceSlot()


def register_source(source: EvidenceSource) -> None:
    """Make ``source`` the evidence every later decision of the default registry reads."""
    SLOT.register(source)


def register_default(factory: Callable[[], EvidenceSource]) -> None:
    """Make ``factory()`` the default registry's source where none is registered, made when a decision first asks for
    evidence (the store's source imports the store's modules, which ``import registry`` leaves for then)."""
    SLOT.register_default(factory)


def source() -> EvidenceSource:
    """The default registry's evidence source."""
    return SLOT.source
