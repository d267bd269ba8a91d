"""The survey's findings: what misbehaves natively and inside ``use()``, summarized and as table lines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from registry.core.status import FAILING, RANK
from registry.harness.outcomes import MISBEHAVING
from registry.harness.survey_rows import SurveyRow


def summarize(rows: Sequence[SurveyRow], worst: int = 40) -> dict[str, Any]:
    """What misbehaves natively: op_db entries by kind and by stack, and the entries with most misbehaving rows."""
    entries = sorted({r.op for r in rows})
    bad = [r for r in rows if r.native_status in MISBEHAVING]
    by_kind = {kind: sorted({r.op for r in bad if r.native_status == kind}) for kind in FAILING}
    stacks = list(dict.fromkeys(r.stack for r in rows))
    by_stack = {s: {kind: len({r.op for r in bad if r.stack == s and r.native_status == kind})
                    for kind in FAILING} for s in stacks}
    per_entry: dict[str, list[SurveyRow]] = {}
    for r in bad:
        per_entry.setdefault(r.op, []).append(r)
    ranked = sorted(per_entry.items(), key=lambda item: (-sum(RANK.index(r.native_status) for r in item[1]), item[0]))
    use_bad = {r.op for r in rows if r.use_status in MISBEHAVING}
    worse_inside = sorted({r.op for r in rows if RANK.index(r.use_status) > RANK.index(r.native_status)
                           and r.use_status in MISBEHAVING})
    return {
        "torch_version": torch.__version__,
        "entries": len(entries),
        "rows": len(rows),
        "misbehaving_natively": len(per_entry),
        "misbehaving_inside_use": len(use_bad),
        "fixed_inside_use": sorted(set(per_entry) - use_bad),
        "worse_inside_use": worse_inside,
        "by_kind": {kind: len(names) for kind, names in by_kind.items()},
        "by_stack": by_stack,
        "unsupported_only": sorted(set(entries) - {r.op for r in rows if r.native_status != "unsupported"}),
        "worst": [
            {"op": op, "rows": len(items),
             "kinds": sorted({r.native_status for r in items}, key=RANK.index),
             "stacks": list(dict.fromkeys(r.stack for r in items)),
             "example": f"{items[0].stack} {items[0].batching} {items[0].dtype}: {items[0].native_status} "
                        f"{items[0].native_detail}"}
            for op, items in ranked[:worst]
        ],
    }


_SHORT = {"ok": "ok", "slow": "slow", "error": "ERR", "mismatch": "MISM", "unsupported": "-"}


def format_rows(rows: Sequence[SurveyRow], stacks: Sequence[str]) -> list[str]:
    """One line per op_db entry: per stack, native's worst status / the worst inside use() over batching and dtype
    (``-`` is unsupported); then one indented line per (stack) that misbehaves, with the worst detail."""
    by_entry: dict[str, list[SurveyRow]] = {}
    for r in rows:
        by_entry.setdefault(r.op, []).append(r)
    width = min(max([len(op) for op in by_entry] + [10]), 36)  # longer names push their row right
    lines = [f"{'op_db entry':{width}s}  " + " ".join(f"{s:>11s}" for s in stacks) + "   (native/use())"]
    for op, items in by_entry.items():
        cells, notes = [], []
        for stack in stacks:
            here = [r for r in items if r.stack == stack]
            if not here:
                cells.append(f"{'':>11s}")
                continue
            native = max(here, key=lambda r: RANK.index(r.native_status))
            used = max(here, key=lambda r: RANK.index(r.use_status))
            cells.append(f"{_SHORT[native.native_status] + '/' + _SHORT[used.use_status]:>11s}")
            if native.native_status in MISBEHAVING or used.use_status in MISBEHAVING:
                worst = native if native.native_status in MISBEHAVING else used
                detail = worst.native_detail if worst is native else worst.use_detail
                notes.append(f"    {stack} {worst.batching} {worst.dtype}: native {native.native_status}, "
                             f"use() {used.use_status}: {detail[:160]}")
        lines.append(f"{op:{width}s}  " + " ".join(cells))
        lines.extend(notes)
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    """The findings in a few lines: counts by kind and stack, and the worst entries."""
    kinds = ", ".join(f"{count} {kind}" for kind, count in summary["by_kind"].items())
    lines = [
        f"{summary['misbehaving_natively']} of {summary['entries']} op_db entries misbehave natively under at least "
        f"one stack (entries with at least one row of that kind: {kinds}); inside use(): "
        f"{summary['misbehaving_inside_use']} ({len(summary['fixed_inside_use'])} fixed, "
        f"{len(summary['worse_inside_use'])} worse)",
        "by stack (entries slow / mismatch / error): " + "; ".join(
            f"{stack} {c['slow']}/{c['mismatch']}/{c['error']}" for stack, c in summary["by_stack"].items()),
    ]
    if summary["worse_inside_use"]:
        lines.append("worse inside use(): " + ", ".join(summary["worse_inside_use"]))
    return "\n".join(lines)

