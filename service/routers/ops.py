from __future__ import annotations

from fastapi import APIRouter, HTTPException

import registry
from registry.selector import unknown_op_message
from service.models import CompositeBase, CompositePublic, OpPublic, OpSummary

router = APIRouter(prefix="/ops", tags=["ops"])


def _base(op: registry.Op) -> dict:
    return {"name": op.name, "doc": op.doc, "entry_points": list(op.qualified_entry_points),
            "tensor_args": list(op.tensor_args)}


@router.get("")
def list_ops() -> list[OpSummary]:
    return [
        OpSummary(**_base(op), composites=[CompositeBase(name=c.name, kind=c.kind, doc=c.doc)
                                           for c in registry.composites(op.name).values()])
        for op in registry.OPS.values()
    ]


@router.get("/{op}")
def get_op(op: str) -> OpPublic:
    if op not in registry.OPS:
        raise HTTPException(status_code=404, detail=unknown_op_message(op))
    return OpPublic(
        **_base(registry.OPS[op]),
        composites=[CompositePublic(name=c.name, kind=c.kind, doc=c.doc, where=c.where, source=c.source)
                    for c in registry.composites(op).values()],
    )
