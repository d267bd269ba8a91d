"""The stored records, declared once: a verified matrix cell, a timing, a job, a check, a worker and a benchmarking
run, and how a row of the evidence tables becomes one. No database library here, so the hot path's reader
(``sqlite_reader``) and the SQLAlchemy store (its declarative classes, ``tables.mapped_record``) share them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from registry.core.stacks import split_stack


def stored(limit: int | None = None, *, index: bool = False, wide: bool = False, primary: bool = False,
           public: bool = True, doc: str = "", default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A record field and how it is stored and shown, declared once: ``limit`` characters (text without one),
    ``index``ed, ``wide`` (a 64-bit integer), the ``primary`` key (else the table has an ``id`` of its own),
    ``public`` (in the HTTP API's models) and what it means (``doc``). A ``dict`` field is stored as JSON text. The
    store's mapped classes (``tables.mapped_record``: SQLAlchemy's declarative layer) and the service's models are
    built from these."""
    metadata = {"limit": limit, "index": index, "wide": wide, "primary": primary, "public": public, "doc": doc}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass(frozen=True)
class MatrixEntry:
    """One verified cell: how ``composite`` of ``op`` fared under ``stack`` for one batching pattern and dtype."""

    op: str = stored(200, index=True)
    composite: str = stored(200)
    kind: str = stored(100)
    stack: tuple[str, ...] = stored(400, doc="transforms, outermost first; () is eager")
    pattern: str = stored(100)
    dtype: str = stored(50)
    status: str = stored(20)
    detail: str = stored()
    max_abs_error: float | None = stored()
    max_rel_error: float | None = stored()
    source_hash: str = stored(200, public=False)
    torch_version: str = stored(100)
    device: str = stored(50)
    # When the harness judged it, epoch seconds (UTC); None in rows stored before revision 0003.
    measured_at: float | None = stored(default=None)


# A matrix cell's identity: a later entry with the same key replaces the stored one.
MATRIX_KEY = ("op", "composite", "stack", "pattern", "dtype", "device", "torch_version")


@dataclass(frozen=True)
class ProfileEntry:
    """One timing: ``composite`` of ``op`` under ``stack`` (as the op sees it) at one size, batch and dtype."""

    op: str = stored(200, index=True)
    composite: str = stored(200)
    kind: str = stored(100)
    stack: tuple[str, ...] = stored(400, doc="the stack the op sees")
    workload: str = stored(100, doc="the transform the timing ran under: vmap, grad, vmap(grad), jacrev, ...")
    dtype: str = stored(50)
    device: str = stored(50)
    device_name: str = stored(200)
    # 64 bits: a CUDA tensor's element count or peak memory passes 2**31 (PostgreSQL's INTEGER is 32 bits).
    numel_bucket: int = stored(wide=True, doc="the op's element count (per sample under vmap), rounded up to a "
                                              "power of two")
    batch_size: int = stored()
    valid: bool = stored()
    detail: str = stored(doc='why it is invalid, or ""')
    median_us: float | None = stored()
    iqr_us: float | None = stored()
    runs: int = stored()
    peak_memory: int | None = stored(wide=True, public=False, doc="bytes, on CUDA")
    source_hash: str = stored(200, public=False)
    torch_version: str = stored(100, public=False)


# A timing's identity: a later timing with the same key replaces the stored one.
PROFILE_KEY = ("op", "composite", "workload", "dtype", "device", "device_name", "numel_bucket", "batch_size",
               "torch_version")


@dataclass
class JobRecord:
    """A verification or profiling job as stored: what was asked, where it stands, and how it ended."""

    id: str = stored(64, primary=True, doc="the job's id: GET /jobs/{id} follows it")
    kind: str = stored(50, doc="verify, profile or check")
    params: dict[str, Any] = stored(doc="what the job runs, as checked and completed from the request: ops, stacks "
                                        "(spelled vmap(grad)) or workloads, dtypes, sizes, device_kind")
    state: str = stored(20, index=True, default="queued",
                        doc="queued, running, cancelling (asked to stop: it stops at its next case boundary), done, "
                            "failed, cancelled or interrupted")
    done: int = stored(default=0, doc="work items finished so far")
    total: int = stored(default=0, doc="work items in all (0 until the job starts)")
    result: dict[str, Any] | None = stored(default=None, doc="when done: counts of what it wrote, and (profile) the "
                                                             "contexts refused as too noisy; null before")
    error: str | None = stored(default=None, doc="why it failed or was interrupted; null otherwise")
    # host:pid of the server that accepted or runs it, or the id of the worker that runs it
    owner: str = stored(300, public=False, default="")
    created_at: float = stored(default_factory=time.time, doc="when it was submitted")
    started_at: float | None = stored(default=None, doc="when it started")
    finished_at: float | None = stored(default=None, doc="when it finished")
    updated_at: float = stored(public=False, default_factory=time.time)


@dataclass(frozen=True)
class CheckRecord:
    """One ``registry.check`` report as stored (``registry/store/checks.py``): the program checked, its verdicts
    natively and inside use(), the three timings, and the whole report."""

    id: str = stored(64, primary=True, doc="the check's id: the id of the job that ran it")
    example: str = stored(100, index=True, doc="the built-in program checked (GET /checks/examples lists them)")
    function: str = stored(400, doc="the per-sample function, with its file and line")
    transform: str = stored(120, doc="the transforms it ran under, spelled vmap(grad)")
    policy: str = stored(20, doc="use()'s policy")
    native_verdict: str = stored(20, doc="native under the transform: ok, slow, mismatch, error (or unchecked)")
    use_verdict: str = stored(20, doc="inside use(): ok, slow, mismatch, error (or unchecked)")
    summary: str = stored(doc="what the check found, in one sentence")
    native_s: float | None = stored(doc="native's median thread CPU time per call, seconds; null where it raised")
    use_s: float | None = stored(doc="use()'s median thread CPU time per call, seconds; null where it raised")
    reference_s: float | None = stored(doc="the per-sample reference's median thread CPU time, seconds")
    report: dict[str, Any] = stored(doc="the whole report: per-output differences, fallbacks, decisions, "
                                        "functionalization, splits (registry.check's CheckReport.to_json())")
    torch_version: str = stored(100, doc="the PyTorch it ran on")
    created_at: float = stored(default_factory=time.time, doc="when it was checked")


@dataclass(frozen=True)
class WorkerRecord:
    """A running ``multicomposite worker`` process (``registry/store/workers.py``): which machine, what it can run,
    when it last beat (the database server's clock, seconds since the epoch) and what it runs now."""

    id: str = stored(300, primary=True)  # host:pid:suffix, also the owner of the jobs it runs
    host: str = stored(300)
    pid: int = stored()
    kinds: str = stored()  # device kinds, comma separated: cpu,cuda:NVIDIA H200
    current_job: str | None = stored()  # the store job ids it runs now, space separated; NULL when idle
    started_at: float = stored()
    heartbeat: float = stored()


@dataclass(frozen=True)
class BenchRun:
    """A benchmarking run (profile, verify) as stored, so that a profile can tell whether another process ran while
    it timed (``evidence_store.EvidenceStore.overlapping_runs``)."""

    id: int = stored(primary=True)  # numbered by the database
    kind: str = stored(50)
    host: str = stored(300)
    pid: int = stored()
    started_at: float = stored()
    finished_at: float | None = stored()  # None while it runs, or when it was killed before it finished


def of_current_sources(records: Iterable[Any], source_hashes: Mapping[tuple[str, str], str]) -> list[Any]:
    """The records (matrix entries, profiles) measured on the composites' current sources: a composite whose source
    changed since makes its rows stale (they stay stored)."""
    return [r for r in records if source_hashes.get((r.op, r.composite)) == r.source_hash]


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
