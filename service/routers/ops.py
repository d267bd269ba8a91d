from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path

import registry
from registry.core.selector import unknown_op_message
from registry.core.stacks import format_stack
from service.deps import StateDep
from service.models import CompositeBase, CompositePublic, OpPublic, OpSummary
from service.views import fresh_matrix, package_relative, verified_stacks

router = APIRouter(prefix="/ops", tags=["ops"])


def _base(op: registry.Op) -> dict:
    return {"name": op.name, "doc": op.doc, "entry_points": list(op.qualified_entry_points),
            "tensor_args": list(op.tensor_args)}


@router.get("")
async def list_ops() -> list[OpSummary]:
    """Every covered op with its tensor arguments, entry points and composites."""
    return [
        OpSummary(**_base(op), composites=[CompositeBase(name=c.name, kind=c.kind, doc=c.doc)
                                           for c in registry.composites(op.name).values()])
        for op in registry.OPS.values()
    ]


# Sync: the first call after a store write reads the store (in the thread pool); the middleware caches the answer.
@router.get("/{op}")
def get_op(op: Annotated[str, Path(max_length=64, description="ATen op packet name, e.g. index_fill")],
           state: StateDep) -> OpPublic:
    """One op: its composites with kind, doc, registration site, source and the stacks where they are verified."""
    if op not in registry.OPS:
        raise HTTPException(status_code=404, detail=unknown_op_message(op))
    verified = verified_stacks(fresh_matrix(state).items, op)
    return OpPublic(
        **_base(registry.OPS[op]),
        composites=[CompositePublic(name=c.name, kind=c.kind, doc=c.doc, where=package_relative(c.where),
                                    source=c.source,
                                    verified=sorted(format_stack(s) for s in verified.get(c.name, [])))
                    for c in registry.composites(op).values()],
    )
