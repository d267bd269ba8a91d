"""Pydantic models of every response, and the base of every request body (``StrictBody``)."""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from registry.core.stacks import format_stack, shorten
from registry.store.records import JobRecord, MatrixEntry, ProfileEntry
from service.timestamps import ISO_EXAMPLE, iso_utc

if TYPE_CHECKING:
    from registry.core.selector import Decision


class StrictBody(BaseModel):
    """A JSON request body: a field it does not declare is refused (422 naming it and the fields there are), never
    ignored: ``{"opz": [...]}`` must not start a job over every op. The schema says so (additionalProperties:
    false)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [name for name in data if name not in cls.model_fields]
            if unknown:
                raise ValueError(f"unknown field {shorten(unknown[0])!r}; the fields are "
                                 f"{', '.join(cls.model_fields)}")
        return data


class ErrorPublic(BaseModel):
    detail: str = Field(description="what is wrong and what to fix")


class Health(BaseModel):
    status: str = "ok"


class VersionPublic(BaseModel):
    multicomposite: str
    torch: str
    device: str


class CompositeBase(BaseModel):
    name: str
    kind: str
    doc: str


class CompositePublic(CompositeBase):
    where: str = Field(description="file:line of the registration, relative to the package's root "
                                   "(composites/index.py:12)")
    source: str
    verified: list[str] = Field(description="stacks, spelled vmap(grad), where every stored matrix entry of this "
                                            "composite is ok")


class OpBase(BaseModel):
    name: str
    doc: str
    entry_points: list[str]
    tensor_args: list[str]


class OpSummary(OpBase):
    composites: list[CompositeBase]


class OpPublic(OpBase):
    composites: list[CompositePublic]


class VerdictPublic(BaseModel):
    composite: str
    kind: str
    ok: bool
    reason: str


STACK_DOC = 'transforms, outermost first, spelled vmap(grad); "" with no transform'


class DecisionPublic(BaseModel):
    op: str
    stack: str = Field(description=STACK_DOC)
    batched: list[str]
    dtype: str | None
    device: str | None
    policy: str
    composite: str
    kind: str
    reason: str
    alternatives: list[VerdictPublic]
    speedup: float | None = Field(description="measured: native's time over the chosen composite's, where both "
                                              "were profiled here; null without timings")
    runner_up_speedup: float | None = Field(description="measured: the next fastest valid composite's time over "
                                                        "the chosen one's; null without two timings")

    @classmethod
    def of(cls, decision: Decision) -> DecisionPublic:
        """The public form of a ``registry.Decision``: what GET /select and ``multicomposite select --json`` give."""
        ctx = decision.context
        return cls(
            op=decision.op, stack=format_stack(ctx.stack), batched=list(ctx.batched),
            dtype=str(ctx.dtype).removeprefix("torch.") if ctx.dtype is not None else None, device=ctx.device,
            policy=decision.policy, composite=decision.composite, kind=decision.kind, reason=decision.reason,
            alternatives=[VerdictPublic(composite=v.composite, kind=v.kind, ok=v.ok, reason=v.reason)
                          for v in decision.alternatives],
            speedup=decision.speedup, runner_up_speedup=decision.runner_up_speedup,
        )


def Timestamp(what: str, *, nullable: str = "") -> Any:  # noqa: N802 -- a Field factory, read as a type
    """A point in time in ISO 8601 UTC (``service.timestamps``), described and typed date-time in the schema."""
    return Field(default=None if nullable else ..., description=f"{what}, ISO 8601 in UTC ({ISO_EXAMPLE})"
                 f"{'; null ' + nullable if nullable else ''}", json_schema_extra={"format": "date-time"})


def record_model(name: str, record: type, *, overrides: dict[str, tuple[Any, Any]]) -> type[BaseModel]:
    """The public model of a stored record (``registry.store.records``), built from its declaration: its public
    fields in their order, typed as declared and described by their ``doc``; ``overrides`` (name to annotation and
    Field) replaces a field whose public form differs (a stack as its spelling, a time in ISO 8601)."""
    hints = typing.get_type_hints(record)
    fields: dict[str, Any] = {}
    for spec in dataclasses.fields(record):
        if not spec.metadata["public"]:
            continue
        doc = spec.metadata["doc"]
        fields[spec.name] = overrides.get(spec.name) or (hints[spec.name], Field(description=doc or None))
    return create_model(name, **fields)


# The matrix's cells as GET /matrix lists them.
MatrixEntryPublic = record_model("MatrixEntryPublic", MatrixEntry, overrides={
    "stack": (str, Field(description=STACK_DOC)),
    "measured_at": (str | None, Timestamp("when it was measured",
                                          nullable="for entries stored before the store kept it")),
})
# The timings as GET /profiles lists them.
ProfilePublic = record_model("ProfilePublic", ProfileEntry, overrides={
    "stack": (str, Field(description="the stack the op sees, spelled vmap(grad)")),
})


class MatrixPage(BaseModel):
    items: list[MatrixEntryPublic]
    total: int = Field(description="entries that match the filters, over all pages")
    next_cursor: str | None = Field(description="pass as cursor for the next page; null on the last")


class ProfilePage(BaseModel):
    items: list[ProfilePublic]
    total: int = Field(description="timings that match the filters, over all pages")
    next_cursor: str | None = Field(description="pass as cursor for the next page; null on the last")


def public_params(params: dict[str, Any]) -> dict[str, Any]:
    """A job's parameters as every output shows them: stacks spelled vmap(grad) (jobs stored before that spelled
    them as lists of names)."""
    stacks = params.get("stacks")
    if stacks is None:
        return dict(params)
    return {**params, "stacks": [s if isinstance(s, str) else format_stack(s) for s in stacks]}


def _doc(record: type, name: str) -> str:
    return next(spec.metadata["doc"] for spec in dataclasses.fields(record) if spec.name == name)


# A job as POST /verify, POST /profiles and GET /jobs/{id} answer it: its times in ISO 8601.
JobPublic = record_model("JobPublic", JobRecord, overrides={
    "created_at": (str, Timestamp(_doc(JobRecord, "created_at"))),
    "started_at": (str | None, Timestamp(_doc(JobRecord, "started_at"), nullable="while queued")),
    "finished_at": (str | None, Timestamp(_doc(JobRecord, "finished_at"), nullable="until it finishes")),
})


def job_public(job: JobRecord) -> BaseModel:
    """The public form of a stored job: its public fields, stacks spelled vmap(grad), times in ISO 8601."""
    values = {name: getattr(job, name) for name in JobPublic.model_fields}
    times = {name: iso_utc(values[name]) for name in ("created_at", "started_at", "finished_at")}
    return JobPublic(**{**values, **times, "params": public_params(job.params)})
