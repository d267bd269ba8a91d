"""``Store``: the evidence store and the jobs store on one database connection, for a process that holds both (the
service, a worker: a job reads and writes its row and writes its results, on one pool and one set of health
checks). A process that needs one of them opens that one: ``evidence_store.EvidenceStore`` (the matrix, the
profiles, the benchmarking runs; the command line's verify, profile, survey and conformance) or
``job_store.JobStore`` (the jobs; ``multicomposite jobs``)."""

from __future__ import annotations

from registry.store.evidence_store import EvidenceStore
from registry.store.job_store import JobStore


class Store(EvidenceStore, JobStore):
    """The evidence and the jobs in one SQL database (SQLite by default), on one engine."""

    def __enter__(self) -> Store:
        return self
