from __future__ import annotations

import torch
from fastapi import APIRouter, HTTPException

import registry
from registry.core.selector import unknown_op_message
from registry.harness.verify import source_hashes
from registry.store.db import Store
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
    with Store() as store:
        entries = store.fresh_entries(source_hashes=source_hashes(), torch_version=torch.__version__, op=op)
    statuses: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for entry in entries:
        statuses.setdefault((entry.composite, entry.stack), set()).add(entry.status)
    return OpPublic(
        **_base(registry.OPS[op]),
        composites=[CompositePublic(name=c.name, kind=c.kind, doc=c.doc, where=c.where, source=c.source,
                                    verified=sorted(",".join(stack) for (name, stack), seen in statuses.items()
                                                    if name == c.name and seen <= {"ok", "unsupported"}
                                                    and "ok" in seen))
                    for c in registry.composites(op).values()],
    )
