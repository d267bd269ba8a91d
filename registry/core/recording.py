"""``use(record=True)``: what the routing decided inside one block, and how often each decision ran.

Recording costs nothing when it is off: a recording block pushes a frame of its own, whose decisions are cached apart
from every other frame's and carry the ``RecordedDecision`` they count into; the C++ kernels send a recording
frame's calls to the Python kernel whole. A ``use()`` nested inside a recording block records into the same run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from registry.core.stacks import format_stack

_serials = itertools.count(1)


@dataclass
class RecordedDecision:
    """One decision the routing made inside a recording block, and the calls it routed there."""

    op: str
    stack: tuple[str, ...]
    composite: str
    kind: str
    reason: str
    batched: tuple[str, ...] = ()  # tensor arguments batched at the innermost vmap level, by schema name
    native_loops: bool = False  # PyTorch's op in vmap's loop by the selector's choice (selector.Decision's)
    calls: int = 0
    overloads: dict[str, int] = field(default_factory=dict)  # aten overload -> calls of it

    def called(self, overload: str) -> None:
        self.calls += 1
        self.overloads[overload] = self.overloads.get(overload, 0) + 1


class Run:
    """What one ``with use(record=True) as run:`` block decided: ``run.decisions``, ``run.calls``, ``run.summary()``."""

    def __init__(self, parent: Run | None = None) -> None:
        self.serial = next(_serials)  # what keeps this run's cached decisions apart from every other frame's
        self.decisions: list[RecordedDecision] = []
        # The run of the recording block this one's block is nested in: it sees this one's decisions too.
        self.parent = parent
        self.frames: dict[Any, Any] = {}  # (policy, pins) -> this run's frame for them (nested use() blocks)

    def decided(self, op: str, stack: tuple[str, ...], composite: str, kind: str, reason: str,
                batched: tuple[str, ...] = (), *, native_loops: bool = False) -> RecordedDecision:
        recorded = RecordedDecision(op=op, stack=stack, composite=composite, kind=kind, reason=reason,
                                    batched=batched, native_loops=native_loops)
        run: Run | None = self
        while run is not None:
            run.decisions.append(recorded)
            run = run.parent
        return recorded

    @property
    def calls(self) -> dict[str, int]:
        """aten overload (``index_fill.int_Scalar``, ``masked_scatter_backward``) -> routed calls of it."""
        counts: dict[str, int] = {}
        for recorded in self.decisions:
            for overload, calls in recorded.overloads.items():
                counts[overload] = counts.get(overload, 0) + calls
        return counts

    def summary(self) -> str:
        """One line per decision: op, stack, composite (kind), calls, and the reason."""
        if not self.decisions:
            return "no call was routed"
        return "\n".join(
            f"{d.op} under {format_stack(d.stack) if d.stack else '(no transform)'}: {d.composite} ({d.kind}), "
            f"{d.calls} call{'s' if d.calls != 1 else ''}; {d.reason}"
            for d in self.decisions
        )
