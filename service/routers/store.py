"""Read-only views of the store: the verified matrix and the profiles."""

from __future__ import annotations

from typing import Annotated

import torch
from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel

import registry
from registry.core.context import parse_stack
from registry.core.selector import unknown_op_message
from registry.harness.verify import source_hashes
from registry.store.db import Store

router = APIRouter(tags=["store"])


class MatrixEntryPublic(BaseModel):
    op: str
    composite: str
    kind: str
    stack: list[str]
    pattern: str
    dtype: str
    status: str
    detail: str
    max_abs_error: float | None
    max_rel_error: float | None
    torch_version: str
    device: str


class ProfilePublic(BaseModel):
    op: str
    composite: str
    kind: str
    stack: list[str]
    workload: str
    dtype: str
    device: str
    device_name: str
    numel_bucket: int
    batch_size: int
    valid: bool
    detail: str
    median_us: float | None
    iqr_us: float | None
    runs: int


def _filters(op: str | None, stack: str | None) -> tuple[str | None, tuple[str, ...] | None]:
    if op is not None and op not in registry.OPS:
        raise HTTPException(status_code=404, detail=unknown_op_message(op))
    try:
        return op, parse_stack(stack) if stack is not None else None
    except ValueError as error:
        raise HTTPException(status_code=422, detail=str(error)) from None


@router.get("/matrix")
def get_matrix(op: Annotated[str | None, Query()] = None,
               stack: Annotated[str | None, Query(description="vmap,grad")] = None) -> list[MatrixEntryPublic]:
    """The stored entries that are fresh for this torch and these composites."""
    op, parsed = _filters(op, stack)
    with Store() as store:
        entries = store.fresh_entries(source_hashes=source_hashes(), torch_version=torch.__version__, op=op)
    return [MatrixEntryPublic(**{**vars(e), "stack": list(e.stack)}) for e in entries
            if parsed is None or e.stack == parsed]


@router.get("/profiles")
def get_profiles(op: Annotated[str | None, Query()] = None,
                 stack: Annotated[str | None, Query(description="the stack the op sees: vmap,grad")] = None,
                 dtype: Annotated[str | None, Query()] = None,
                 device: Annotated[str | None, Query()] = None) -> list[ProfilePublic]:
    """The stored timings that are fresh for this torch and these composites."""
    op, parsed = _filters(op, stack)
    with Store() as store:
        profiles = store.fresh_profiles(source_hashes=source_hashes(), torch_version=torch.__version__, op=op)
    return [ProfilePublic(**{k: v for k, v in vars(p).items() if k in ProfilePublic.model_fields and k != "stack"},
                          stack=list(p.stack))
            for p in profiles
            if (parsed is None or p.stack == parsed) and (dtype is None or p.dtype == dtype)
            and (device is None or p.device == device)]
