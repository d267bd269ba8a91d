"""What is known, without running anything, about where a composite works: the rules behind policy ``rules``.

Each rule was measured on torch 2.13 with ``registry.harness.checks`` against a Python loop of native PyTorch (the tests
re-measure every one of them); the evidence string says what was seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from registry.core.context import Context


@dataclass(frozen=True)
class Problem:
    status: str  # slow | error | mismatch
    evidence: str


Rule = Callable[[Context], "Problem | None"]


def _under_vmap(ctx: Context) -> bool:
    # Under torch.compile the functorch stack inside the graph is invisible: assume a vmap may be there.
    return "vmap" in ctx.stack or "compile" in ctx.stack


# Ops whose backward (shared by the native op and its in-place form) has no batching rule on 2.13.
_UNBATCHED_BACKWARD = {"masked_scatter": "aten::masked_scatter_backward"}


def _backward_problem(op: str, ctx: Context) -> Problem | None:
    """Problems of the derivative formulas that the native op shares with its in-place form."""
    if op == "index_fill" and (
        "grad" in ctx.stack or "jvp" in ctx.stack or ("autograd" in ctx.stack and "value" in ctx.tensors)
    ):
        # The formulas index with the raw, negative, index: the gradient of a tensor value always does, and
        # functorch's grad and jvp do for self too.
        return Problem("error", "index_fill's derivative formulas fail on negative indices (INDICES element is "
                                "out of DATA bounds) under torch.func grad and jvp, and for a tensor value")
    if op in _UNBATCHED_BACKWARD and "grad" in ctx.stack:
        # jacrev and hessian run the forward under grad alone, then vmap over the backward.
        return Problem("slow", f"{_UNBATCHED_BACKWARD[op]} has no batching rule, and jacrev and hessian vmap "
                               "over the backward")
    return None


def _native_masked_scatter(ctx: Context) -> Problem | None:
    if _under_vmap(ctx):
        return Problem("slow", "aten::masked_scatter has no batching rule, so vmap runs a per-sample loop")
    return _backward_problem("masked_scatter", ctx)


def _native_masked_fill(ctx: Context) -> Problem | None:
    if _under_vmap(ctx) and "value" in ctx.tensors:
        return Problem("slow", "aten::masked_fill.Tensor has no batching rule, so vmap runs a per-sample loop")
    return None


def _native_index_fill(ctx: Context) -> Problem | None:
    if not _under_vmap(ctx):
        return _backward_problem("index_fill", ctx)
    if "value" in ctx.tensors and not ctx.self_covers_batching:
        return Problem("mismatch", "index_fill with a batched value into an unbatched self returns wrong values "
                                   "under vmap")
    return Problem("error", "index_fill decomposes to index_fill_, which vmap rejects under vmap(jacfwd) and "
                            "vmap(vmap) and loops over with a tensor value")


def _native_memory_format(op: str) -> Rule:
    def rule(ctx: Context) -> Problem | None:
        if _under_vmap(ctx):
            return Problem("error", f"{op} with a memory_format other than contiguous_format fails under vmap "
                                    "(NYI: is_contiguous / clone(memory_format) inside vmap)")
        return None

    return rule


NATIVE_RULES: dict[str, Rule] = {
    "masked_scatter": _native_masked_scatter,
    "masked_fill": _native_masked_fill,
    "index_fill": _native_index_fill,
    "contiguous": _native_memory_format("contiguous"),
    "to": _native_memory_format("to"),
}


def _mutating(ctx: Context) -> Problem | None:
    if _under_vmap(ctx):
        if not ctx.self_covers_batching:
            return Problem("error", "an in-place op cannot write a batched argument into an unbatched clone of self")
        return Problem("error", "in-place ops under vmap raise or fall back to vmap's per-sample loop "
                                "(measured under vmap, vmap(grad), vmap(jacfwd) and hessian)")
    return None


def _mutating_forward_ad(op: str, ctx: Context) -> Problem | None:
    if op == "to" and "jvp" in ctx.stack:
        return Problem("mismatch", "copy_'s forward-AD formula keeps the source's dtype, so the tangent of a "
                                   "dtype-changing to comes out in the wrong dtype")
    return None


def _primitive(ctx: Context) -> Problem | None:
    if "functionalize" in ctx.stack:
        return Problem("error", "functionalize has no rule for torch.autograd.Function (NYI: custom_function_call)")
    if "compile" in ctx.stack:
        return Problem("error", "Dynamo does not trace a torch.autograd.Function with a custom jvp under torch.func "
                                "transforms (measured: masked_scatter under compile(grad))")
    return None


def _functional(ctx: Context) -> Problem | None:
    return None


KIND_RULES: dict[str, Rule] = {"mutating": _mutating, "functional": _functional, "primitive": _primitive}


def problem(op: str, kind: str, ctx: Context) -> Problem | None:
    """The known problem of ``op``'s ``kind`` composite in ``ctx``, or None when the rules know of none."""
    if kind == "native":
        rule = NATIVE_RULES.get(op)
        return rule(ctx) if rule else None
    if kind == "mutating":
        return _mutating(ctx) or _backward_problem(op, ctx) or _mutating_forward_ad(op, ctx)
    return KIND_RULES[kind](ctx)


def preference(ctx: Context) -> tuple[str, ...]:
    """Kinds in order of preference.

    Without a profile the rules put functional before primitive under vmap: the functional composites need nothing
    but PyTorch's ops and verify everywhere, while the fused primitives' speed depends on the machine (their C
    kernels need gcc; for index_add and index_copy they measured 0.6x-0.8x native, for masked_fill 3x-6.8x). Where a
    profile exists, ``auto`` picks the fastest valid composite beyond the noise (bench/fused.py, bench/kinds.py).
    """
    if _under_vmap(ctx):
        return ("native", "functional", "primitive", "mutating")
    return ("native", "mutating", "functional", "primitive")


def preference_reason(ctx: Context) -> str:
    if _under_vmap(ctx):
        return "under vmap out-of-place ops batch without in-place writes (no profile here to rank the primitive)"
    return "outside vmap PyTorch's own kernel, then clone-and-mutate, are cheapest"
