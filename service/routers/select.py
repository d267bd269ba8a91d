from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Query, Request
from pydantic import Field

import registry
from registry.core.selector import POLICIES, SelectionError, unknown_op_message
from registry.core.stacks import MAX_STACK_TEXT, shorten
from service.models import DecisionPublic, StrictBody
from service.validation import (
    MAX_DIMS,
    MAX_SIZE,
    InputError,
    check_dtype_under_stack,
    parse_device,
    parse_dtype,
    parse_shapes,
    parse_stack_input,
)

router = APIRouter(tags=["select"])

MAX_QUERIES = 256


def _names(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


OP_DOC = "ATen op packet name, e.g. index_fill (GET /ops lists them)"
STACK_IN_DOC = 'transforms, outermost first: vmap(grad) or vmap,grad; "" with no transform'
DTYPE_DOC = "the arguments' dtype: float32, float64, int64, bool, ..."
DEVICE_DOC = "a device type this host has, or one a profile names: cpu, cuda, ..."
NUMEL_DOC = "elements per sample: picks the profiled size nearest to it"
POLICY_DOC = "how to choose: auto, fastest, rules or native"
PIN_DOC = "force a kind or composite for this op, e.g. functional"
SHAPES_DOC = ("each tensor argument's per-sample shape, for an op decided by its cost at the call's sizes "
              "(scaled_dot_product_attention, ctc_loss, pdist): every tensor argument or none")
SHAPES_TEXT_DOC = "per-sample shapes as name:AxBxC, comma-separated, e.g. query:1x2x16x16,key:1x2x16x16,value:1x2x16x16"
BATCH_SIZE_DOC = "the samples the first tensor argument stands for (the product of its vmap batch sizes)"
RULES_DOC = ("whether this package's C++ batching rules would serve PyTorch's kernel (use() on the C++ routing "
             "backend): native is then weighed with them")
Shape = Annotated[list[Annotated[int, Field(ge=0, le=MAX_SIZE)]], Field(max_length=MAX_DIMS)]


class SelectQuery(StrictBody):
    op: str = Field(max_length=64, description=OP_DOC)
    stack: str = Field(default="", max_length=MAX_STACK_TEXT, description=STACK_IN_DOC)
    batched: list[str] = Field(default=[], max_length=8, description="tensor arguments batched at the innermost "
                               "vmap, e.g. [\"self\", \"value\"]")
    dtype: str | None = Field(default=None, max_length=32, description=DTYPE_DOC)
    device: str | None = Field(default=None, max_length=32, description=DEVICE_DOC)
    numel: int | None = Field(default=None, ge=0, le=2**40, description=NUMEL_DOC)
    policy: str = Field(default="auto", max_length=16, description=POLICY_DOC)
    pin: str | None = Field(default=None, max_length=40, description=PIN_DOC)
    shapes: dict[Annotated[str, Field(max_length=64)], Shape] | None = Field(default=None, max_length=8,
                                                                              description=SHAPES_DOC)
    batch_size: int = Field(default=1, ge=0, le=2**31, description=BATCH_SIZE_DOC)
    native_batch_rules: bool = Field(default=False, description=RULES_DOC)


def _decide(request: Request, op: str, stack: str, batched: list[str], dtype: str | None, device: str | None,
            numel: int | None, policy: str, pin: str | None, shapes: dict[str, list[int]] | None = None,
            batch_size: int = 1, native_batch_rules: bool = False) -> DecisionPublic:
    """Check every value against its closed set, then ask the selector (whose cache these values key)."""
    state = request.app.state.store_state
    state.require()  # decisions read the store's evidence: 503 while it cannot be read
    if op not in registry.OPS:
        raise HTTPException(status_code=404, detail=unknown_op_message(op))
    tensor_args = registry.OPS[op].tensor_args
    unknown = [name for name in batched if name not in tensor_args]
    if unknown:
        raise InputError(f"batched name {shorten(unknown[0])!r} is not a tensor argument of {op}; its tensor "
                         f"arguments are {', '.join(tensor_args)}")
    if policy not in POLICIES:
        raise InputError(f"unknown policy {shorten(policy, 16)!r}; policies are {', '.join(POLICIES)}")
    parsed = parse_stack_input(stack)
    torch_dtype = parse_dtype(dtype) if dtype is not None else None
    check_dtype_under_stack(torch_dtype, parsed)
    device_type = parse_device(device, state.device_types()) if device is not None else None
    try:
        decision = registry.select(op, stack=parsed, batched=batched, dtype=torch_dtype, device=device_type,
                                   numel=numel, policy=policy, pins={op: pin} if pin else None, shapes=shapes,
                                   batch_size=batch_size, native_batch_rules=native_batch_rules)
    except SelectionError as error:
        raise HTTPException(status_code=422, detail=str(error)) from None
    return DecisionPublic.of(decision)


@router.post("/select")
async def select_many(request: Request, queries: Annotated[list[SelectQuery], Body(
        max_length=MAX_QUERIES, description="up to 256 queries, each with the fields of GET /select")]
                      ) -> list[DecisionPublic]:
    """Up to 256 queries in one call; the first bad one answers for the request, named by its index. A read: it
    needs no token."""
    answers = []
    for index, query in enumerate(queries):
        try:
            answers.append(_decide(request, query.op, query.stack, query.batched, query.dtype, query.device,
                                   query.numel, query.policy, query.pin, query.shapes, query.batch_size,
                                   query.native_batch_rules))
        except HTTPException as error:
            raise HTTPException(status_code=error.status_code, detail=f"query {index}: {error.detail}") from None
        except InputError as error:
            raise InputError(f"query {index}: {error}") from None
    return answers


# async: a decision is a cached dict lookup, cheaper than the hop to a worker thread that a sync route costs; and
# every value is checked against a fixed table first, so no input can make it import or load anything.
@router.get("/select")
async def select(
    request: Request,
    op: Annotated[str, Query(max_length=64, description=OP_DOC)],
    stack: Annotated[str, Query(max_length=MAX_STACK_TEXT, description=STACK_IN_DOC)] = "",
    batched: Annotated[str | None, Query(max_length=200, description="comma-separated tensor arguments batched at "
                                                                     "the innermost vmap, e.g. self,value")] = None,
    dtype: Annotated[str | None, Query(max_length=32, description=DTYPE_DOC)] = None,
    device: Annotated[str | None, Query(max_length=32, description=DEVICE_DOC)] = None,
    numel: Annotated[int | None, Query(ge=0, le=2**40, description=NUMEL_DOC)] = None,
    policy: Annotated[str, Query(max_length=16, description=POLICY_DOC)] = "auto",
    pin: Annotated[str | None, Query(max_length=40, description=PIN_DOC)] = None,
    shapes: Annotated[str | None, Query(max_length=600, description=SHAPES_TEXT_DOC)] = None,
    batch_size: Annotated[int, Query(ge=0, le=2**31, description=BATCH_SIZE_DOC)] = 1,
    native_batch_rules: Annotated[bool, Query(description=RULES_DOC)] = False,
) -> DecisionPublic:
    """The decision for one op under a stack: the composite, the reason, every alternative's verdict, and the
    measured speedups; with ``shapes`` and ``batch_size``, at those sizes."""
    return _decide(request, op, stack, _names(batched), dtype, device, numel, policy, pin, parse_shapes(shapes),
                   batch_size, native_batch_rules)
