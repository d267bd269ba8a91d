"""Verification and profiling jobs: POST /verify, POST /profiles (202 + Location), GET and DELETE /jobs/{id}; the
check jobs' POST /checks is ``service/routers/checks.py``'s."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Response
from fastapi import Path as FastAPIPath
from pydantic import Field, ValidationInfo, field_validator

import registry
from registry.core.selector import unknown_op_message
from registry.core.stacks import canonical_workload, format_stack, shorten
from registry.profiling.timing import WORKLOADS
from service.deps import Authorized, JobsDep, SettingsDep
from service.jobs.backend import Job, QueueFullError
from service.jobs.kinds import DEFAULT_KIND, resolve_kind
from service.models import JobPublic, StrictBody, job_public
from service.validation import InputError, parse_stack_input

router = APIRouter(tags=["jobs"])

Dtype = Literal["float32", "float64"]
Name = Annotated[str, Field(max_length=64)]

# What an omitted (or null) list means; an empty list is refused, since it would name nothing to run.
EVERY = {"ops": "every covered op", "stacks": "every stack of the matrix", "workloads": "every workload",
         "dtypes": "float32"}


def _not_empty(value: list | None, info: ValidationInfo) -> list | None:
    if value is not None and not value:
        raise ValueError(f"an empty list names nothing to run; leave {info.field_name} out (or null) for "
                         f"{EVERY[info.field_name]}")
    return value


class VerifyCreate(StrictBody):
    ops: list[Name] | None = Field(default=None, max_length=64, description="ops to verify, e.g. [\"index_fill\"]; "
                                   "omitted or null: every covered op (GET /ops lists them); [] is refused")
    stacks: list[Annotated[str, Field(max_length=120)]] | None = Field(
        default=None, max_length=256, description='stacks, e.g. ["vmap", "vmap(grad)"] (vmap,grad works too); '
                                                  "omitted or null: every stack of the matrix; [] is refused")
    dtypes: list[Dtype] = Field(default=["float32"], max_length=2, description="float32, float64 or both "
                                "(default: float32)")

    _check_lists = field_validator("ops", "stacks", "dtypes")(_not_empty)


class ProfileCreate(StrictBody):
    ops: list[Name] | None = Field(default=None, max_length=64, description="ops to time; omitted or null: every "
                                   "covered op; [] is refused")
    workloads: list[Annotated[str, Field(max_length=32)]] | None = Field(
        default=None, max_length=16, description="vmap, grad, vmap(grad) (or vmap,grad), jacrev, jacfwd, hessian; "
                                                 "omitted or null: every workload; [] is refused")
    batch_sizes: list[int] = Field(default=[32], min_length=1, max_length=16,
                                   description="samples per batch, each 1..MAX_BATCH (default 1024)")
    numels: list[int] = Field(default=[1024], min_length=1, max_length=16, description="elements per sample; "
                              "batch x numel at most MAX_NUMEL (default 2**24)")
    dtypes: list[Dtype] = Field(default=["float32"], max_length=2, description="float32, float64 or both "
                                "(default: float32)")
    device: str = Field(default="cpu", max_length=16, description="a device type this host has: cpu, cuda")
    device_kind: str | None = Field(default=None, max_length=120, description=(
        "the machines to run on: cpu or cuda:NAME (with a PostgreSQL store, one a worker registered); default: "
        "the one kind of the device's type"))
    min_run_time: float = Field(default=0.05, gt=0, le=5, description="seconds each context is timed for, over "
                                "its rounds")

    _check_lists = field_validator("ops", "workloads", "dtypes")(_not_empty)


def _public(job: Job) -> JobPublic:
    return job_public(job)


def _check_ops(ops: list[str] | None) -> list[str]:
    for op in ops or []:
        if op not in registry.OPS:
            raise HTTPException(status_code=404, detail=unknown_op_message(op))
    return ops or list(registry.OPS)


def submit(backend: JobsDep, kind: str, params: dict, response: Response) -> JobPublic:
    try:
        job = backend.submit(kind, params)
    except QueueFullError:
        raise HTTPException(status_code=429, detail="the job queue is full; retry later",
                            headers={"Retry-After": "30"}) from None
    response.status_code = 202
    response.headers["Location"] = f"/jobs/{job.id}"
    return _public(job)


@router.post("/verify", status_code=202, dependencies=[Authorized])
def post_verify(body: VerifyCreate, backend: JobsDep, settings: SettingsDep, response: Response) -> JobPublic:
    """Start a verify job: 202 with the job and Location: /jobs/{id} (needs the token when the server sets one)."""
    ops = _check_ops(body.ops)
    # One spelling in the job's params, as in every output: vmap(grad) (verify parses it back).
    stacks = [format_stack(parse_stack_input(s)) for s in body.stacks] if body.stacks is not None else None
    contexts = len(ops) * (len(stacks) if stacks is not None else 63) * len(body.dtypes)
    if contexts > settings.max_contexts:
        raise HTTPException(status_code=422, detail=f"{contexts} (op, stack, dtype) contexts is over the limit of "
                                                    f"{settings.max_contexts} per job; name fewer ops or stacks")
    params = {"ops": ops, "stacks": stacks, "dtypes": body.dtypes, "device_kind": DEFAULT_KIND}
    return submit(backend, "verify", params, response)


@router.post("/profiles", status_code=202, dependencies=[Authorized])
def post_profiles(body: ProfileCreate, backend: JobsDep, settings: SettingsDep, response: Response) -> JobPublic:
    """Start a profile job: 202 with the job and Location: /jobs/{id} (needs the token when the server sets one)."""
    ops = _check_ops(body.ops)
    # With workers, a device type is available when a worker runs it; in process, when this host has it.
    kinds, device_types = backend.device_kinds(), backend.device_types()
    if body.device not in device_types:
        raise InputError(f"device {shorten(body.device, 16)!r} is not {backend.where}; profile on "
                         f"{', '.join(device_types)}")
    try:
        device_kind = resolve_kind(body.device_kind, body.device, kinds)
    except ValueError as error:
        raise InputError(str(error)) from None
    try:
        workloads = [canonical_workload(w) for w in body.workloads] if body.workloads else list(WORKLOADS)
    except ValueError as error:
        raise InputError(str(error)) from None
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise InputError(f"unknown workload {shorten(unknown[0], 32)!r}; workloads are {', '.join(WORKLOADS)}")
    for batch in body.batch_sizes:
        if not 1 <= batch <= settings.max_batch:
            raise HTTPException(status_code=422, detail=f"batch size {batch} is outside 1..{settings.max_batch} "
                                                        "(max_batch)")
    for numel in body.numels:
        if not 1 <= numel <= settings.max_numel:
            raise HTTPException(status_code=422, detail=f"numel {numel} is outside 1..{settings.max_numel} "
                                                        "elements per tensor (max_numel)")
        if max(body.batch_sizes) * numel > settings.max_numel:
            raise HTTPException(status_code=422, detail=f"batch {max(body.batch_sizes)} x numel {numel} is over "
                                                        f"{settings.max_numel} elements per tensor (max_numel)")
    contexts = len(ops) * len(workloads) * len(body.batch_sizes) * len(body.numels) * len(body.dtypes)
    if contexts > settings.max_contexts:
        raise HTTPException(status_code=422, detail=f"{contexts} profiling contexts is over the limit of "
                                                    f"{settings.max_contexts} per job (max_contexts)")
    params = {"ops": ops, "workloads": workloads, "batch_sizes": body.batch_sizes, "numels": body.numels,
              "dtypes": body.dtypes, "device": body.device, "min_run_time": body.min_run_time,
              "device_kind": device_kind}
    return submit(backend, "profile", params, response)


JobId = Annotated[str, FastAPIPath(description="the id POST /verify or POST /profiles answered")]


@router.get("/jobs/{job_id}")
def get_job(job_id: JobId, backend: JobsDep) -> JobPublic:
    """A job's state, progress, parameters, result or error, and its times."""
    job = backend.status(job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job {shorten(job_id)!r}")
    return _public(job)


@router.delete("/jobs/{job_id}", dependencies=[Authorized],
               responses={202: {"model": JobPublic, "description": "running: it stops at its next case boundary"}})
def delete_job(job_id: JobId, backend: JobsDep, response: Response) -> JobPublic:
    """Cancel a job (needs the token when the server sets one): a queued one at once (200, cancelled), a running
    one at its next case boundary (202, cancelling; GET /jobs/{id} says cancelled once it stopped). A finished job
    cannot be cancelled (409)."""
    job = backend.cancel(job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job {shorten(job_id)!r}")
    if job.state == "cancelling":
        response.status_code = 202
    elif job.state != "cancelled":
        raise HTTPException(status_code=409, detail=f"job {shorten(job_id)} is {job.state} already; only a queued or "
                                                    "running job can be cancelled")
    return _public(job)
