"""The stored evidence records, declared once: a verified matrix cell and a timing, and how a row of their table
becomes one. No database library here, so the hot path's reader (``sqlite_reader``) and the SQLAlchemy store
(``db``) share them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from registry.core.stacks import split_stack


@dataclass(frozen=True)
class MatrixEntry:
    """One verified cell: how ``composite`` of ``op`` fared under ``stack`` for one batching pattern and dtype."""

    op: str
    composite: str
    kind: str
    stack: tuple[str, ...]  # transform names, outermost first; () is eager
    pattern: str
    dtype: str
    status: str
    detail: str
    max_abs_error: float | None
    max_rel_error: float | None
    source_hash: str
    torch_version: str
    device: str
    measured_at: float | None = None  # when the harness judged it, epoch seconds (UTC); None in rows before 0003


@dataclass(frozen=True)
class ProfileEntry:
    """One timing: ``composite`` of ``op`` under ``stack`` (as the op sees it) at one size, batch and dtype."""

    op: str
    composite: str
    kind: str
    stack: tuple[str, ...]
    workload: str  # the user-level transform the timing ran under: "vmap(grad)", "jacrev", ...
    dtype: str
    device: str
    device_name: str
    numel_bucket: int  # the op's element count (per sample under vmap), rounded up to a power of two
    batch_size: int
    valid: bool
    detail: str  # why it is invalid, or ""
    median_us: float | None
    iqr_us: float | None
    runs: int
    peak_memory: int | None  # bytes, on CUDA
    source_hash: str
    torch_version: str


def decode_stack(value: str) -> tuple[str, ...]:
    """Either spelling: rows written before schema 2 say vmap,grad."""
    return tuple(split_stack(value))


def matrix_entry_from_mapping(row: Mapping[str, Any]) -> MatrixEntry:
    """A ``matrix_entries`` row (column name to value) as its record."""
    return MatrixEntry(
        op=row["op"],
        composite=row["composite"],
        kind=row["kind"],
        stack=decode_stack(row["stack"]),
        pattern=row["pattern"],
        dtype=row["dtype"],
        status=row["status"],
        detail=row["detail"],
        max_abs_error=row["max_abs_error"],
        max_rel_error=row["max_rel_error"],
        source_hash=row["source_hash"],
        torch_version=row["torch_version"],
        device=row["device"],
        measured_at=row["measured_at"],
    )


PROFILE_FIELDS = tuple(ProfileEntry.__dataclass_fields__)


def profile_from_mapping(row: Mapping[str, Any]) -> ProfileEntry:
    """A ``profiles`` row (column name to value) as its record."""
    values = {name: row[name] for name in PROFILE_FIELDS}
    return ProfileEntry(**{**values, "stack": decode_stack(values["stack"]), "valid": bool(values["valid"])})
