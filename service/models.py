"""Pydantic models of every response."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
    where: str = Field(description="file:line of the registration")
    source: str
    verified: list[str] = Field(description="stacks (outermost first, comma-joined) where every stored matrix entry "
                                            "of this composite is ok")


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


class DecisionPublic(BaseModel):
    op: str
    stack: list[str]
    batched: list[str]
    dtype: str | None
    device: str | None
    policy: str
    composite: str
    kind: str
    reason: str
    alternatives: list[VerdictPublic]
