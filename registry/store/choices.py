"""What ``auto`` chooses on a given body of evidence, rather than on the default store's: the cells where native
fails and the choice there, and the choice per op under a few stacks. The selector reads process-wide evidence, so
each function swaps it in for its length and puts the default store back after (``evidence_of``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from registry.core.ops import OPS
from registry.core.registration import load
from registry.core.selector import SelectionError, select
from registry.core.stacks import format_stack
from registry.store import evidence
from registry.store.evidence import FAILING
from registry.store.records import MatrixEntry, ProfileEntry


@contextmanager
def evidence_of(entries: Sequence[MatrixEntry], profiles: Sequence[ProfileEntry] | None = None) -> Iterator[None]:
    """Decisions inside the block see ``entries`` (and ``profiles``, unless None: then the default store's); after
    it, the default store's again."""
    evidence.set_entries(entries)
    if profiles is not None:
        evidence.set_profiles(profiles)
    try:
        yield
    finally:
        evidence.use_loader(None)
        if profiles is not None:
            evidence.use_profile_loader(None)


def batched_for(op: str, pattern: str, stack: tuple[str, ...]) -> tuple[str, ...]:
    """The tensor arguments a matrix pattern batches: what the selector is asked for that cell."""
    if "vmap" not in stack:
        return ()
    load()
    tensor_args = OPS[op].tensor_args
    if pattern == "self":
        return ("self",)
    if pattern == "others":
        return tuple(name for name in tensor_args if name != "self")
    return tensor_args  # all, in_dims1


def native_failures(entries: Sequence[MatrixEntry], profiles: Sequence[ProfileEntry] = ()) -> list[dict[str, Any]]:
    """Each cell where the native composite is slow, errs or mismatches, with the choice policy ``auto`` makes there
    on this evidence (``entries``, ``profiles``): composite, kind, its status in the same cell and the reason."""
    status = {(e.op, e.composite, e.stack, e.pattern, e.dtype): e for e in entries}
    failing = [e for e in entries if e.kind == "native" and e.status in FAILING]
    rows = []
    with evidence_of(entries, profiles):
        for e in sorted(failing, key=lambda e: (e.op, len(e.stack), e.stack, e.pattern, e.dtype)):
            row = {"op": e.op, "stack": format_stack(e.stack), "pattern": e.pattern, "dtype": e.dtype,
                   "native_status": e.status, "native_detail": e.detail}
            try:
                decision = select(e.op, stack=e.stack, batched=batched_for(e.op, e.pattern, e.stack),
                                           dtype=e.dtype)
            except SelectionError as error:
                rows.append({**row, "composite": None, "kind": None, "status": None, "reason": str(error)})
                continue
            there = status.get((e.op, decision.composite, e.stack, e.pattern, e.dtype))
            rows.append({**row, "composite": decision.composite, "kind": decision.kind,
                         "status": there.status if there is not None else "not verified",
                         "reason": decision.reason})
    return rows


def choices_by_op(entries: Sequence[MatrixEntry], stacks: Sequence[tuple[str, ...]],
                  rank: Sequence[str]) -> dict[str, dict[tuple[str, ...], tuple[str, str] | None]]:
    """Per op of ``entries`` and per stack of ``stacks``: the composite auto chooses with the op's first tensor
    batched (the matrix's pattern ``self``, the usual vmap over data) on this evidence, and that composite's worst
    status (by ``rank``, mildest first) in that pattern there ("not run" without an entry); None where no composite
    is valid."""
    worst: dict[tuple[str, str, tuple[str, ...]], str] = {}
    for e in entries:
        if "vmap" in e.stack and e.pattern != "self":
            continue
        key = (e.op, e.composite, e.stack)
        if key not in worst or rank.index(e.status) > rank.index(worst[key]):
            worst[key] = e.status
    choices: dict[str, dict[tuple[str, ...], tuple[str, str] | None]] = {}
    load()
    with evidence_of(entries):
        for op in dict.fromkeys(e.op for e in entries):
            choices[op] = {}
            for stack in stacks:
                batched = OPS[op].tensor_args[:1] if "vmap" in stack else ()
                try:
                    decision = select(op, stack=stack, batched=batched)
                except SelectionError:
                    choices[op][stack] = None
                    continue
                choices[op][stack] = (decision.composite, worst.get((op, decision.composite, stack), "not run"))
    return choices
