"""Checks of built-in programs: POST /checks (202 + Location of its job), GET /checks, GET /checks/{id}, GET
/checks/examples.

A check job runs ``registry.check`` on one of the programs shipped with the package (``service.check_examples``),
named by the request: never on code or a module path a request sends, since the server would then run whatever the
sender chose. Users check their own code on their own machine (``multicomposite check``, ``registry.check``).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi import Path as FastAPIPath
from pydantic import BaseModel, Field

from registry.core.stacks import shorten
from registry.store.checks import stored_check, stored_checks
from registry.store.records import CheckRecord
from service.check_examples import EXAMPLES
from service.deps import Authorized, JobsDep, StoreDep
from service.jobs.kinds import DEFAULT_KIND
from service.models import JobPublic, StrictBody, Timestamp, record_model
from service.routers.jobs import submit
from service.timestamps import iso_utc

router = APIRouter(tags=["checks"])

MAX_ROUNDS = 20


class CheckCreate(StrictBody):
    example: str = Field(max_length=64, description="the built-in program to check (GET /checks/examples lists "
                                                    "them), e.g. gpt2-per-sample-grads")
    policy: Literal["auto", "fastest", "rules", "native"] = Field(default="auto", description="use()'s policy")
    rounds: int = Field(default=5, ge=1, le=MAX_ROUNDS, description="interleaved timing rounds (the median is "
                                                                    "kept)")


class ExamplePublic(BaseModel):
    name: str = Field(description="what POST /checks names")
    description: str = Field(description="the program and what it computes")
    transform: str = Field(description="the transforms it runs under, spelled vmap(grad)")
    in_dims: list[int | None] = Field(description="each argument's batch dim (null: not batched)")
    argnums: int = Field(description="the argument differentiated")
    available: bool = Field(description="false where a library it needs is not installed on the server")
    needs: str | None = Field(description="that library, or null")


_CHECK_TIMES = {"created_at": (str, Timestamp("when it was checked"))}
CheckSummary = record_model("CheckSummary", CheckRecord, overrides={
    **_CHECK_TIMES, "report": (dict[str, Any] | None, Field(default=None, description="null in the list: GET "
                                                                                      "/checks/{id} has it"))})
CheckPublic = record_model("CheckPublic", CheckRecord, overrides=_CHECK_TIMES)


def _available(needs: str | None) -> bool:
    return needs is None or importlib.util.find_spec(needs) is not None


@router.get("/checks/examples")
def get_examples() -> list[ExamplePublic]:
    """The built-in programs a check job can run."""
    return [ExamplePublic(name=e.name, description=e.description, transform=e.transform, in_dims=list(e.in_dims),
                          argnums=e.argnums, available=_available(e.needs), needs=e.needs) for e in EXAMPLES.values()]


@router.post("/checks", status_code=202, dependencies=[Authorized])
def post_check(body: CheckCreate, backend: JobsDep, response: Response) -> JobPublic:
    """Start a check of a built-in program: 202 with the job and Location: /jobs/{id}; the report is stored as
    GET /checks/{id} (the job's id) when the job is done. Needs the token when the server sets one."""
    example = EXAMPLES.get(body.example)
    if example is None:
        raise HTTPException(status_code=404, detail=f"no example {shorten(body.example)!r}; examples: "
                                                    f"{', '.join(EXAMPLES)}")
    if not _available(example.needs):
        raise HTTPException(status_code=422, detail=f"example {example.name} needs {example.needs}, which this "
                                                    "server does not have installed; choose another example")
    params = {"example": example.name, "policy": body.policy, "rounds": body.rounds, "device_kind": DEFAULT_KIND}
    return submit(backend, "check", params, response)


def _values(record: CheckRecord, model: type[BaseModel], *, report: bool) -> BaseModel:
    values = {name: getattr(record, name) for name in model.model_fields}
    return model(**{**values, "created_at": iso_utc(record.created_at), "report": record.report if report else None})


@router.get("/checks")
def get_checks(store: StoreDep, limit: Annotated[int, Query(ge=1, le=1000, description="at most this many, "
                                                                                        "newest first")] = 100,
               ) -> list[CheckSummary]:  # type: ignore[valid-type]
    """The stored checks, newest first, without their reports."""
    return [_values(record, CheckSummary, report=False) for record in stored_checks(store, limit=limit)]


CheckId = Annotated[str, FastAPIPath(max_length=64, description="the id of the job that ran it")]


@router.get("/checks/{check_id}")
def get_check(check_id: CheckId, store: StoreDep) -> CheckPublic:  # type: ignore[valid-type]
    """One stored check with its whole report."""
    record = stored_check(store, check_id)
    if record is None:
        raise HTTPException(status_code=404, detail=f"no check {shorten(check_id)!r}; GET /checks lists them")
    return _values(record, CheckPublic, report=True)
