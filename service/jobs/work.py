"""``make_job_work(store)``: what a verify, a profile or a check job does, the same whether the service's own runner
(``local``) or a ``multicomposite worker`` (``worker``) runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from registry.store.evidence_store import EvidenceStore
    from service.jobs.backend import Job, JobWork, Progress


def make_job_work(store_: EvidenceStore, on_written: Callable[[], None] = lambda: None) -> JobWork:
    """``on_written``: called after a job writes the store and before it is reported done, so that a client that
    sees the job done never reads a response cached before the write (the watcher would notice only at its poll)."""

    def run_job(job: Job, progress: Progress) -> dict[str, Any]:
        import torch

        from registry.harness.stored_verify import verify_into
        from registry.profiling.stored_profile import profile_into

        params = job.params
        if job.kind == "check":
            result = run_check(store_, job, progress)
            on_written()
            return result
        dtypes = [getattr(torch, name) for name in params["dtypes"]]  # names checked against a closed Literal

        def report(done: int, total: int, _label: str = "") -> None:
            progress(done, total)

        if job.kind == "verify":
            # One process: forking a threaded server is unsafe. Writing bumps the generation: watchers reload.
            entries = verify_into(store_, ops=params["ops"], stacks=params["stacks"], dtypes=dtypes, progress=report,
                                  workers=1)
            on_written()
            counts: dict[str, int] = {}
            for entry in entries:
                counts[entry.status] = counts.get(entry.status, 0) + 1
            return {"entries": len(entries), "statuses": counts}
        refused: list[str] = []
        profiles = profile_into(store_, ops=params["ops"], workloads=params["workloads"], numels=params["numels"],
                                batch_sizes=params["batch_sizes"], dtypes=dtypes, device=params["device"],
                                min_run_time=params["min_run_time"], progress=report, refused=refused)
        on_written()
        # Contexts whose timings stayed disturbed are not stored: the result says which, and why.
        return {"profiles": len(profiles), "timed": sum(p.valid for p in profiles), "refused": refused}

    return run_job


def run_check(store_: EvidenceStore, job: Job, progress: Progress) -> dict[str, Any]:
    """A check job: one of the built-in programs (``service.check_examples``, named in the params; never code sent
    with the request) through ``registry.check``; the report is stored under the job's id."""
    import torch

    import registry
    from registry.store.checks import write_check
    from registry.store.records import CheckRecord
    from service.check_examples import EXAMPLES

    params = job.params
    example = EXAMPLES[params["example"]]  # checked against EXAMPLES when the job was submitted
    progress(0, 1)
    fn, args = example.build()
    report = registry.check(fn, *args, transform=example.transform, in_dims=example.in_dims, argnums=example.argnums,
                            policy=params["policy"], rounds=params["rounds"])
    write_check(store_, CheckRecord(
        id=job.id, example=example.name, function=report.function, transform=report.transform, policy=report.policy,
        native_verdict=report.native.verdict, use_verdict=report.use.verdict, summary=report.summary(),
        native_s=report.native.time_s, use_s=report.use.time_s, reference_s=report.reference.time_s,
        report=report.to_json(), torch_version=torch.__version__))
    progress(1, 1)
    return {"check": job.id, "native": report.native.verdict, "use": report.use.verdict, "ok": report.ok}
