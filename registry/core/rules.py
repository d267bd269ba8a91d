"""What is known, without running anything, about where a composite works: the rules behind policy ``rules``.

Each rule was measured on torch 2.13 with ``registry.harness.checks`` against a Python loop of native PyTorch (the tests
re-measure every one of them); the evidence string says what was seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from registry.core import kinds
from registry.core.context import Context
from registry.core.kinds import Problem, Rule

_under_vmap = kinds.under_vmap  # the rules of the kinds (registry.core.kinds) and of the ops read vmap alike



# op -> kind -> its rule: filled by ``define_op(..., rules=...)`` from the composites module that defines the op, so an
# op's rules sit next to its composites. The rules of a kind as such (KIND_RULES) apply first, to every op.
OP_RULES: dict[str, dict[str, Rule]] = {}


@dataclass(frozen=True)
class Order:
    """An op's own order of kinds in some contexts, where measurement ranked its kinds otherwise than
    ``preference`` does (the fused attention primitive before the math composite under vmap)."""

    kinds: tuple[str, ...]
    reason: str


# op -> what gives its own Order in a context (None: the general preference): ``define_op(..., preference=...)``.
OP_PREFERENCES: dict[str, Callable[[Context], Order | None]] = {}


# --- rule families: what the op-specific tables are made of -------------------------------------------------------


def first_of(*rules: Rule) -> Rule:
    """The first problem any of ``rules`` finds."""

    def rule(ctx: Context) -> Problem | None:
        for each in rules:
            found = each(ctx)
            if found is not None:
                return found
        return None

    return rule


def no_batching_rule(aten: str, *, status: str = "slow", detail: str = "") -> Rule:
    """``aten`` (the op's own forward) has no batching rule: vmap loops over the batch (``slow``) or raises."""
    what = detail or ("vmap runs a per-sample loop" if status == "slow" else "vmap raises")
    evidence = f"{aten} has no batching rule, so {what}"

    def rule(ctx: Context) -> Problem | None:
        return Problem(status, evidence) if _under_vmap(ctx) else None

    return rule


def backward_without_batching_rule(aten: str, *, status: str = "slow") -> Rule:
    """A derivative op ``aten`` that the op's backward calls has no batching rule: slow under vmap(grad), and under
    grad alone too, because jacrev and hessian run the forward under grad and vmap over the backward."""
    evidence = f"the backward calls {aten}, which has no batching rule; vmap(grad), jacrev and hessian vmap over it"

    def rule(ctx: Context) -> Problem | None:
        return Problem(status, evidence) if "grad" in ctx.stack else None

    return rule


def forward_ad_without_batching_rule(aten: str, *, status: str = "slow") -> Rule:
    """The op's forward-AD formula calls ``aten``, which has no batching rule: jacfwd and vmap(jvp) loop or raise."""
    evidence = f"the forward-AD formula calls {aten}, which has no batching rule (jacfwd is vmap over jvp)"

    def rule(ctx: Context) -> Problem | None:
        return Problem(status, evidence) if "jvp" in ctx.stack and _under_vmap(ctx) else None

    return rule


def no_forward_ad(aten: str) -> Rule:
    """``aten`` (the op's own forward) has no forward-AD formula: jvp, jacfwd and hessian raise."""
    return fails_when(lambda ctx: "jvp" in ctx.stack, "error",
                      f"forward AD of {aten} is not implemented (jvp, jacfwd and hessian raise)")


def second_derivative(ctx: Context) -> bool:
    """Whether a derivative of a derivative is taken: grad twice (hessian, grad of grad), or grad and jvp (hessian)."""
    return ctx.stack.count("grad") > 1 or ("grad" in ctx.stack and "jvp" in ctx.stack)


def no_second_derivative(aten: str) -> Rule:
    """``aten`` (the op's backward) has no derivative of its own: grad of grad and hessian raise."""
    return fails_when(second_derivative, "error",
                      f"the derivative of {aten} is not implemented (grad of grad and hessian raise)")


def fails_when(predicate: Callable[[Context], bool], status: str, evidence: str) -> Rule:
    """A measured problem in the contexts ``predicate`` accepts."""

    def rule(ctx: Context) -> Problem | None:
        return Problem(status, evidence) if predicate(ctx) else None

    return rule


def batched_without_batching_rule(aten: str, *args: str, status: str = "slow", detail: str = "") -> Rule:
    """``aten`` has no batching rule and falls back (``slow``) or raises only where one of ``args`` (schema names) is
    batched: vmap's per-sample loop runs where the op sees a BatchedTensor, so jacfwd (whose primal is unbatched) and
    jacrev (vmap over the backward only) run the op's own kernel. Nested vmaps, and torch.compile (whose graph hides
    the functorch stack), are assumed batched: the context names the arguments batched at the innermost level only."""
    what = detail or ("vmap runs a per-sample loop" if status == "slow" else "vmap raises")
    evidence = f"{aten} has no batching rule, so {what} where {' or '.join(args)} is batched"

    def rule(ctx: Context) -> Problem | None:
        if not _under_vmap(ctx):
            return None
        if "compile" in ctx.stack or ctx.stack.count("vmap") > 1 or any(arg in ctx.batched for arg in args):
            return Problem(status, evidence)
        return None

    return rule


def under_vmap(ctx: Context) -> bool:
    return _under_vmap(ctx)


def under_vmap_with(transform: str) -> Callable[[Context], bool]:
    """A predicate: under vmap with ``transform`` on the stack too (vmap(grad); jacfwd is vmap over jvp)."""
    return lambda ctx: _under_vmap(ctx) and transform in ctx.stack


def per_sample_gradients(ctx: Context) -> bool:
    """vmap(grad) or vmap(jacrev): under vmap, one level that differentiates and it a grad level, and autograd not
    recording outside the transforms. Where the per-sample ops of our own (linear's, the rows ops) are preferred."""
    differentiating = ctx.stack.count("grad") + ctx.stack.count("jvp")
    return _under_vmap(ctx) and "grad" in ctx.stack and differentiating == 1 and "autograd" not in ctx.stack


def innermost_vmap(ctx: Context) -> bool:
    """The innermost transform is vmap. An op that decomposes under autograd (CompositeImplicitAutograd:
    ``narrow.Tensor``, ``column_stack``, ``lu_solve``, ``linalg.tensorsolve``) reaches the Batched key undecomposed
    only there: it loops or raises under vmap, not under vmap(grad) or vmap(jvp)."""
    return bool(ctx.stack) and ctx.stack[-1] == "vmap"


# The rules of the kinds as such (each kind's entry in registry.core.kinds holds its own).
KIND_RULES: dict[str, Rule] = {name: kind.rule for name, kind in kinds.KIND.items() if kind.rule is not None}


def problem(op: str, kind: str, ctx: Context, op_rules: dict[str, dict[str, Rule]] | None = None) -> Problem | None:
    """The known problem of ``op``'s ``kind`` composite in ``ctx``, or None when the rules know of none: the rule of
    the kind as such first, then the op's own rule for that kind (in ``op_rules``, an op table's; default: the
    default table's)."""
    generic = KIND_RULES.get(kind)
    found = generic(ctx) if generic is not None else None
    if found is not None:
        return found
    specific = (OP_RULES if op_rules is None else op_rules).get(op, {}).get(kind)
    return specific(ctx) if specific is not None else None


Preferences = dict[str, Callable[[Context], "Order | None"]]


def _own_order(ctx: Context, op: str | None, preferences: Preferences | None) -> Order | None:
    specific = (OP_PREFERENCES if preferences is None else preferences).get(op) if op is not None else None
    return specific(ctx) if specific is not None else None


def preference(ctx: Context, op: str | None = None, preferences: Preferences | None = None) -> tuple[str, ...]:
    """Kinds in order of preference: ``op``'s own order where its ``define_op`` gives one here (in ``preferences``,
    an op table's; default: the default table's), else the general one.

    Without a profile the rules put functional before primitive under vmap: the functional composites need nothing
    but PyTorch's ops and verify everywhere, while the fused primitives' speed depends on the machine (their C
    kernels need gcc; for index_add and index_copy they measured 0.6x-0.8x native, for masked_fill 3x-6.8x). Where a
    profile exists, ``auto`` picks the fastest valid composite beyond the noise (bench/fused.py, bench/kinds.py).
    """
    own = _own_order(ctx, op, preferences)
    if own is not None:
        return own.kinds
    return kinds.order(_under_vmap(ctx))


def preference_reason(ctx: Context, op: str | None = None, preferences: Preferences | None = None) -> str:
    own = _own_order(ctx, op, preferences)
    if own is not None:
        return own.reason
    if _under_vmap(ctx):
        return "under vmap out-of-place ops batch without in-place writes (no profile here to rank the primitive)"
    return "outside vmap PyTorch's own kernel, then clone-and-mutate, are cheapest"
