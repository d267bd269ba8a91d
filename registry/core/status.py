"""The statuses a measurement ends in: one vocabulary for the verified matrix, the survey, the store and the
selector, with one order of how bad each is.

``ok``: agrees with the reference; ``slow``: agrees, but through vmap's per-sample fallback; ``mismatch``: a wrong
value or gradient; ``error``: raised where the reference did not; ``unsupported``: nothing could be checked (no
sample of that dtype, a reference that itself fails).
"""

from __future__ import annotations

from collections.abc import Iterable

# Each status with its severity, in the order messages and choices list them. Over several samples (or entries of
# one context) the most severe wins; "unsupported" is the mildest, so one sample that cannot be checked does not
# hide another that can, and an error outranks a mismatch as the matrix and the survey have always aggregated.
SEVERITY: dict[str, int] = {"ok": 1, "slow": 2, "error": 4, "mismatch": 3, "unsupported": 0}
STATUSES: tuple[str, ...] = tuple(SEVERITY)
# Mildest first, worst last.
RANK: tuple[str, ...] = tuple(sorted(SEVERITY, key=SEVERITY.__getitem__))
# What makes a composite invalid where it was measured (policy ``auto``), and a survey row a coverage gap.
FAILING: tuple[str, ...] = tuple(s for s in RANK if SEVERITY[s] > SEVERITY["ok"])


def worst(statuses: Iterable[str]) -> str:
    """The most severe of ``statuses`` (at least one)."""
    return max(statuses, key=SEVERITY.__getitem__)
