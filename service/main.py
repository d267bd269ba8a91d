"""``create_app(settings)``: the FastAPI app."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import registry
from service import dashboard
from service.jobs import Job, JobRunner
from service.metrics import Metrics
from service.models import ErrorPublic
from service.routers import jobs, meta, ops, select, store
from service.settings import Settings


def _run_job(job: Job, progress: Callable[[int, int], None]) -> dict[str, Any]:
    import torch

    from registry.harness.verify import verify
    from registry.profiling.timing import profile
    from registry.store import evidence
    from registry.store.db import Store

    params = job.params
    dtypes = [getattr(torch, name) for name in params["dtypes"]]

    def report(done: int, total: int, _label: str = "") -> None:
        progress(done, total)

    with Store() as db:
        if job.kind == "verify":
            # One process: forking a threaded server is unsafe.
            entries = verify(ops=params["ops"], stacks=params["stacks"], dtypes=dtypes, progress=report, workers=1)
            db.write_entries(entries)
            evidence.use_loader(None)
            counts: dict[str, int] = {}
            for entry in entries:
                counts[entry.status] = counts.get(entry.status, 0) + 1
            return {"entries": len(entries), "statuses": counts}
        profiles = profile(ops=params["ops"], workloads=params["workloads"], numels=params["numels"],
                           batch_sizes=params["batch_sizes"], dtypes=dtypes, device=params["device"],
                           min_run_time=params["min_run_time"], progress=report)
        db.write_profiles(profiles)
        evidence.use_profile_loader(None)
        return {"profiles": len(profiles), "timed": sum(p.valid for p in profiles)}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    if settings.db:
        os.environ["MULTICOMPOSITE_DB"] = settings.db  # the registry's store and evidence read it
    registry.load()
    app = FastAPI(title="multicomposite", description="Which decomposition of a PyTorch op fits a transform stack",
                  responses={code: {"model": ErrorPublic} for code in (401, 404, 409, 413, 422, 429)})

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        # One readable string, like every other error of this API: where, and what is wrong.
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()]
        return JSONResponse(status_code=422, content={"detail": "; ".join(parts)})
    app.state.settings = settings
    app.state.runner = JobRunner(_run_job, settings.queue_size, settings.job_timeout_s)
    app.state.metrics = metrics = Metrics(app.state.runner)

    @app.middleware("http")
    async def limit_and_measure(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return JSONResponse(status_code=413, content={
                "detail": f"request body of {length} bytes is over the limit of {settings.max_body_bytes}"})
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.observe(getattr(route, "path", "unmatched"), request.method, response.status_code,
                        time.perf_counter() - start)
        return response

    for module in (meta, ops, select, store, jobs, dashboard):
        app.include_router(module.router)
    app.get("/metrics", include_in_schema=False)(metrics.endpoint)
    return app
