"""Read-only views of the store, paged: the verified matrix and the profiles. Each page carries an ETag (the
middleware adds it), and a matching If-None-Match gets 304."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import APIRouter, HTTPException, Query

import registry
from registry.core.selector import unknown_op_message
from registry.core.stacks import MAX_STACK_TEXT, format_stack, shorten
from registry.core.status import STATUSES
from registry.store.records import MatrixEntry, ProfileEntry
from service.deps import StateDep
from service.models import MatrixEntryPublic, MatrixPage, ProfilePage, ProfilePublic
from service.timestamps import iso_utc
from service.validation import InputError, parse_dtype, parse_stack_input
from service.views import fresh_matrix, fresh_profiles, page

router = APIRouter(tags=["store"])
PublicT = TypeVar("PublicT", MatrixEntryPublic, ProfilePublic)

Limit = Annotated[int, Query(ge=1, le=1000, description="entries per page, 1..1000")]
Cursor = Annotated[str | None, Query(max_length=1000, description="next_cursor of the previous page")]
OpFilter = Annotated[str | None, Query(max_length=64, description="only this op, e.g. index_fill")]
StackFilter = Annotated[str | None, Query(max_length=MAX_STACK_TEXT, description="vmap(grad) or vmap,grad")]
CompositeFilter = Annotated[str | None, Query(max_length=64, description="a composite name: functional, ...")]


def _public(model: type[PublicT], row: object) -> PublicT:
    fields = model.model_fields
    values = {k: v for k, v in vars(row).items() if k in fields and k != "stack"}
    if "measured_at" in values:
        values["measured_at"] = iso_utc(values["measured_at"])
    return model(**values, stack=format_stack(row.stack))  # type: ignore[attr-defined]


def _op(op: str | None) -> str | None:
    if op is not None and op not in registry.OPS:
        raise HTTPException(status_code=404, detail=unknown_op_message(op))
    return op


def _stack(stack: str | None) -> tuple[str, ...] | None:
    return parse_stack_input(stack) if stack is not None else None


def _composite(op: str | None, composite: str | None) -> str | None:
    if composite is None:
        return None
    known = registry.composites(op) if op is not None else {n for c in registry.COMPOSITES.values() for n in c}
    if composite not in known:
        raise InputError(f"no composite {shorten(composite)!r}{' of ' + op if op else ''}; composites: "
                         f"{', '.join(sorted(known))}")
    return composite


@router.get("/matrix")
def get_matrix(state: StateDep, op: OpFilter = None, composite: CompositeFilter = None,
               status: Annotated[str | None, Query(max_length=16, description="only this status: "
                                                                             + ", ".join(STATUSES))] = None,
               stack: StackFilter = None, limit: Limit = 100, cursor: Cursor = None) -> MatrixPage:
    """The stored entries fresh for this torch and these composites, ordered by op, composite, stack, pattern."""
    op = _op(op)
    composite = _composite(op, composite)
    parsed = _stack(stack)
    if status is not None and status not in STATUSES:
        raise InputError(f"unknown status {shorten(status, 16)!r}; statuses are {', '.join(STATUSES)}")

    def keep(e: MatrixEntry) -> bool:
        return ((op is None or e.op == op) and (composite is None or e.composite == composite)
                and (status is None or e.status == status) and (parsed is None or e.stack == parsed))

    items, next_cursor, total = page(fresh_matrix(state), keep, limit, cursor)
    return MatrixPage(items=[_public(MatrixEntryPublic, e) for e in items], total=total, next_cursor=next_cursor)


@router.get("/profiles")
def get_profiles(state: StateDep, op: OpFilter = None, composite: CompositeFilter = None,
                 stack: Annotated[str | None, Query(max_length=MAX_STACK_TEXT,
                                                    description="the stack the op sees: vmap(grad) or vmap,grad")
                                  ] = None,
                 status: Annotated[str | None, Query(max_length=16, description="only valid (timed) or invalid "
                                                                               "timings")] = None,
                 dtype: Annotated[str | None, Query(max_length=32, description="only this dtype, e.g. float32")
                                  ] = None,
                 device: Annotated[str | None, Query(max_length=32, description="only this device type: cpu, "
                                                                               "cuda, ...")] = None,
                 limit: Limit = 100, cursor: Cursor = None) -> ProfilePage:
    """The stored timings fresh for this torch and these composites, ordered by op, workload, size, batch."""
    op = _op(op)
    composite = _composite(op, composite)
    parsed = _stack(stack)
    if status is not None and status not in ("valid", "invalid"):
        raise InputError(f"unknown status {shorten(status, 16)!r}; a timing is valid or invalid")
    dtype_name = str(parse_dtype(dtype)).removeprefix("torch.") if dtype is not None else None
    if device is not None and device not in state.device_types():
        raise InputError(f"device {shorten(device)!r} is neither on this host nor in a profile; devices: "
                         f"{', '.join(state.device_types())}")

    def keep(p: ProfileEntry) -> bool:
        return ((op is None or p.op == op) and (composite is None or p.composite == composite)
                and (parsed is None or p.stack == parsed) and (dtype_name is None or p.dtype == dtype_name)
                and (device is None or p.device == device)
                and (status is None or p.valid == (status == "valid")))

    items, next_cursor, total = page(fresh_profiles(state), keep, limit, cursor)
    return ProfilePage(items=[_public(ProfilePublic, p) for p in items], total=total, next_cursor=next_cursor)
