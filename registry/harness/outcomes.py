"""The outcome of one check (``checks.check``, an OpInfo case), and how outcomes aggregate: the worst wins."""

from __future__ import annotations

from dataclasses import dataclass

from registry.core.status import FAILING, RANK

# Over the samples of one row the worst status wins (RANK, registry.core.status: "unsupported" mildest).
MISBEHAVING: frozenset[str] = frozenset(FAILING)


@dataclass(frozen=True)
class Outcome:
    status: str  # one of RANK
    detail: str = ""
    max_abs_error: float | None = None
    max_rel_error: float | None = None


def worse_outcome(a: Outcome | None, b: Outcome) -> Outcome:
    """The worse of two outcomes (RANK); ``b`` when there is no ``a`` yet."""
    return b if a is None or RANK.index(b.status) > RANK.index(a.status) else a

