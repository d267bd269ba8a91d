"""Where a built-in composite breaks the rules' promise: the matrix entries in which a non-native composite
mismatches or errs although the rules say it works under that stack. ``multicomposite verify`` exits 1 on any."""

from __future__ import annotations

from collections.abc import Sequence

import registry
from registry.core import rules
from registry.core.context import Context
from registry.store.records import MatrixEntry


def claim_failures(entries: Sequence[MatrixEntry]) -> list[MatrixEntry]:
    """Non-native entries that mismatch or err where ``rules.problem`` finds nothing wrong."""
    failures = []
    for entry in entries:
        if entry.kind == "native" or entry.status not in ("mismatch", "error"):
            continue
        ctx = Context(stack=entry.stack, tensors=registry.OPS[entry.op].tensor_args)
        if rules.problem(entry.op, entry.kind, ctx) is None:
            failures.append(entry)
    return failures
