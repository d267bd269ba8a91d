from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Query
from pydantic import BaseModel, Field

import registry
from registry.core.selector import SelectionError, unknown_op_message
from service.models import DecisionPublic, VerdictPublic

router = APIRouter(tags=["select"])


def _names(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


class SelectQuery(BaseModel):
    op: str
    stack: str = ""
    batched: list[str] = []
    dtype: str | None = None
    device: str | None = None
    numel: int | None = Field(default=None, ge=0, le=2**40)
    policy: str = "auto"
    pin: str | None = None


@router.post("/select")
async def select_many(queries: Annotated[list[SelectQuery], Body(max_length=256)]) -> list[DecisionPublic]:
    """Up to 256 queries in one call; the first bad one answers for the request, named by its index."""
    if len(queries) > 256:
        raise HTTPException(status_code=422, detail=f"{len(queries)} queries is over the limit of 256 per call")
    answers = []
    for index, query in enumerate(queries):
        try:
            answers.append(await select(query.op, query.stack, ",".join(query.batched), query.dtype, query.device,
                                  query.numel, query.policy, query.pin))
        except HTTPException as error:
            raise HTTPException(status_code=error.status_code, detail=f"query {index}: {error.detail}") from None
    return answers


# async: a decision is a cached dict lookup, cheaper than the hop to a worker thread that a sync route costs.
@router.get("/select")
async def select(
    op: Annotated[str, Query(description="ATen op packet name, e.g. index_fill")],
    stack: Annotated[str, Query(description="transforms, outermost first: vmap,grad")] = "",
    batched: Annotated[str | None, Query(description="tensor arguments batched at the innermost vmap")] = None,
    dtype: Annotated[str | None, Query(description="float32, float64, int64, bool, ...")] = None,
    device: Annotated[str | None, Query(description="cpu, cuda, ...")] = None,
    numel: Annotated[int | None, Query(ge=0, le=2**40)] = None,
    policy: Annotated[str, Query(description="auto, rules or native")] = "auto",
    pin: Annotated[str | None, Query(description="force a kind or composite for this op")] = None,
) -> DecisionPublic:
    if op not in registry.OPS:
        raise HTTPException(status_code=404, detail=unknown_op_message(op))
    try:
        decision = registry.select(op, stack=stack, batched=_names(batched), dtype=dtype, device=device, numel=numel,
                                   policy=policy, pins={op: pin} if pin else None)
    except SelectionError as error:
        raise HTTPException(status_code=422, detail=str(error)) from None
    ctx = decision.context
    return DecisionPublic(
        op=op, stack=list(ctx.stack), batched=list(ctx.batched),
        dtype=str(ctx.dtype).removeprefix("torch.") if ctx.dtype else None, device=ctx.device, policy=policy,
        composite=decision.composite, kind=decision.kind, reason=decision.reason,
        alternatives=[VerdictPublic(composite=v.composite, kind=v.kind, ok=v.ok, reason=v.reason)
                      for v in decision.alternatives],
    )
