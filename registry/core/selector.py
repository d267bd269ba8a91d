"""The selector: which composite of an op to run in a context, and why."""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from registry.core import cost, evidence, kernels, reference, rules
from registry.core.context import Context
from registry.core.kinds import KINDS, NATIVE
from registry.core.model import Composite
from registry.core.ops import OPS
from registry.core.policies import POLICIES
from registry.core.ratios import MIN_NOISE, ratio_text
from registry.core.registration import TABLE, OpTable
from registry.core.stacks import format_stack, parse_stack, shorten


class SelectionError(ValueError):
    """No composite can be chosen as asked: an unknown op or policy, an invalid pin, or nothing valid."""


@dataclass(frozen=True)
class Verdict:
    composite: str
    kind: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class Decision:
    op: str
    composite: str
    kind: str
    reason: str
    alternatives: tuple[Verdict, ...]
    context: Context
    policy: str
    speedup: float | None = None  # measured: native's time over the choice's, where both were profiled
    runner_up_speedup: float | None = None  # measured: the runner-up's time over the choice's
    # PyTorch's own op in vmap's per-sample loop, chosen: by its cost at the call's sizes, or as the only valid one
    native_loops: bool = False
    # The chosen composite's function, from the op table that decided (not part of what the decision says).
    function: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    @property
    def fn(self) -> Callable[..., Any]:
        if self.function is None:
            raise RuntimeError(f"Decision({self.op}/{self.composite}) was made without its function; report this bug")
        return self.function


# Decisions a selector keeps, at most CACHE_SIZE (the oldest goes first): a key holds caller-supplied values (device,
# size), so an unbounded dict would grow with every distinct query.
CACHE_SIZE = 4096


def unknown_op_message(op: str, ops: Mapping[str, Any] | None = None) -> str:
    """That ``op`` is not covered (by ``ops``, an op table's; default: the default table's), with close names."""
    ops = OPS if ops is None else ops
    op = shorten(op)  # an error never echoes more than a short prefix of what was sent
    close = difflib.get_close_matches(op, ops, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "."
    return f"unknown op {op!r}{hint} {covered_ops(ops)}"


def covered_ops(ops: Mapping[str, Any] | None = None) -> str:
    """How an error names the covered ops: every name while they are few, else the count and where to list them."""
    ops = OPS if ops is None else ops
    if len(ops) <= 8:
        return f"Covered ops: {', '.join(ops)}"
    return f"{len(ops)} ops are covered: list them with `multicomposite ops` or GET /ops"


def _describe(ctx: Context) -> str:
    where = format_stack(ctx.stack) if ctx.stack else "(no transform)"
    if ctx.batched:
        where += f" with {', '.join(ctx.batched)} batched"
    return where


Judged = list[tuple[Composite, "rules.Problem | None"]]


# What a choice rests on (``Choice.basis``): each has its own explanation.
PINNED, POLICY_NATIVE, SLOW_NATIVE, COST, MEASURED, REFERENCE, RULES = (
    "pinned", "policy native", "slow native", "cost", "measured", "reference", "rules")


@dataclass(frozen=True)
class Reference:
    """The shipped reference profiles' say, where they move the rules' choice: the fastest valid composite there."""

    found: reference.ReferenceTimes
    fastest: str
    fastest_us: float
    rules_choice: str  # the rules' choice, which the reference replaces
    rules_us: float | None


@dataclass(frozen=True)
class Choice:
    """What ``choose`` decided and everything its explanation needs, before any prose (``explain`` writes it)."""

    op: str
    ctx: Context
    policy: str
    chosen: Composite
    basis: str
    judged: Judged
    verified: Mapping[str, int]
    pin: str | None = None
    # The composites of kinds preferred to the choice's that are invalid here, with their problems, in order.
    skipped: tuple[tuple[Composite, rules.Problem], ...] = ()
    # MEASURED: the timings of the candidates, the fastest valid one, whether the rules' choice stayed because the
    # profiles cannot tell it from the fastest, and the runner-up (score, name).
    measured: Mapping[str, Any] = field(default_factory=dict)
    fastest: Any = None
    within_noise: bool = False
    runner_up: tuple[float, str] | None = None
    reference: Reference | None = None  # REFERENCE
    costed: cost.Costed | None = None  # COST: native or a composite by cost at the call's sizes (registry.core.cost)
    speedup: float | None = None
    runner_up_speedup: float | None = None
    order_reason: str = ""  # RULES: why the preferred kinds come in their order here (``rules.preference_reason``)


def _rank(order: tuple[str, ...], kind: str) -> int:
    """A kind's place in ``order``; a kind an op's own order does not name comes after every kind it names."""
    return order.index(kind) if kind in order else len(order)


def explain(choice: Choice) -> str:
    """Why ``choice`` was made, in a sentence (the Decision's ``reason``, without its final period)."""
    op, ctx, policy, chosen = choice.op, choice.ctx, choice.policy, choice.chosen
    where = _describe(ctx)
    if choice.basis == PINNED:
        return f"pinned to {choice.pin} by the caller"
    if choice.basis == POLICY_NATIVE:
        return "policy native routes nothing: PyTorch's own op runs"
    if choice.basis == SLOW_NATIVE:
        listed = ", ".join(f"{c.name} [{p.status}]" for c, p in choice.judged if p is not None)
        return (f"no composite is valid under {where} ({listed}); PyTorch's own {op} runs, in vmap's per-sample "
                "loop, as it does without use()")
    if choice.basis == COST:
        if choice.costed is None:
            raise RuntimeError(f"explain({op}): a choice by cost without its cost; report this bug")
        return choice.costed.reason
    skipped = ""
    if choice.skipped:
        first, problem = choice.skipped[0]
        skipped = f"; {first.name} is invalid here ({problem.status}: {problem.evidence})"
    if choice.basis == MEASURED:
        measured, fastest = choice.measured, choice.fastest
        best = measured[chosen.name]
        native = next((c.name for c, _ in choice.judged if c.kind == NATIVE.name), None)
        parts = []
        if choice.speedup is not None and chosen.kind != NATIVE.name:
            parts.append(ratio_text(best.score_us / measured[native].score_us, "native"))
        runner_up = choice.runner_up
        if runner_up is not None and not (runner_up[1] == native and parts):  # native said once, not twice
            parts.append(ratio_text(best.score_us / runner_up[0], runner_up[1]))
        batches = ",".join(str(b) for b in best.batch_sizes)
        if choice.within_noise:
            reason = (f"{chosen.name} is the rules' choice under {where}, and the profiles do not tell it from the "
                      f"fastest, {fastest.composite}, beyond the noise ({'; '.join(parts)}, spread "
                      f"{max(fastest.spread, best.spread):.0%}; profiled at {best.bucket} elements, batch "
                      f"{batches})")
        else:
            reason = (f"{chosen.name} is the fastest valid composite measured under {where} "
                      f"({'; '.join(parts) or 'the only one timed'}; profiled at {best.bucket} elements, batch "
                      f"{batches})")
        return reason + skipped
    if choice.basis == REFERENCE:
        shipped = choice.reference
        assert shipped is not None
        found = shipped.found
        versus = (ratio_text(shipped.fastest_us / shipped.rules_us, shipped.rules_choice)
                  if shipped.rules_us is not None else f"{shipped.rules_choice} was not timed there")
        reason = (f"{shipped.fastest} is the fastest valid composite under {where} in the reference profiles shipped "
                  f"with the package ({versus}; {found.workload}, batch {found.batch} x {found.numel} elements, "
                  f"measured on {found.machine}); no profile of this machine here: `multicomposite profile` measures "
                  "one")
        if policy == "auto":
            reason += _verified(choice, " (unverified: no measurement yet, the reference profiles decide)")
        return reason
    if chosen.kind == NATIVE.name:
        reason = f"PyTorch's own {op} has no known problem under {where}"
    elif choice.skipped:
        worse, problem = choice.skipped[0]
        reason = (f"{worse.name} fails under {where} ({problem.status}: {problem.evidence}); "
                  f"{chosen.name} is the next choice: {choice.order_reason}")
    else:
        reason = f"{chosen.name} is preferred under {where}: {choice.order_reason}"
    if policy == "fastest":
        reason += " (no profile here: rules decide)"
    elif policy == "auto":
        reason += _verified(choice, " (unverified: no measurement yet, rules decide)")
    return reason


def _verified(choice: Choice, unverified: str) -> str:
    count = choice.verified.get(choice.chosen.name, 0)
    entries = "matrix entry" if count == 1 else "matrix entries"
    return f" (verified: {count} {entries} ok here)" if count else unverified




def _reference_choice(op: str, ctx: Context, policy: str, chosen: Composite, valid: Judged) -> Reference | None:
    """Where no local profile speaks: the fastest valid composite in the shipped reference profiles, when it is
    faster than the rules' choice there by more than ``reference.MIN_GAP``; None keeps the rules' choice."""
    if policy not in ("auto", "fastest") or chosen.kind == NATIVE.name:
        # Where the rules keep PyTorch's own op, only a profile of this machine moves the choice off it.
        return None
    found = reference.reference_times(op, ctx.stack, None if ctx.dtype is None
                                      else str(ctx.dtype).removeprefix("torch."), ctx.batched)
    if found is None:
        return None
    ranked = sorted((found.times_us[c.name], c.name) for c, _ in valid
                    if c.name in found.times_us and c.kind != NATIVE.name)
    if not ranked or ranked[0][1] == chosen.name:
        return None
    fastest_us, fastest = ranked[0]
    rules_us = found.times_us.get(chosen.name)
    if rules_us is not None and rules_us <= fastest_us * (1 + reference.MIN_GAP):
        return None
    return Reference(found=found, fastest=fastest, fastest_us=fastest_us, rules_choice=chosen.name, rules_us=rules_us)


def _alternatives(judged: Judged, chosen: Composite) -> tuple[Verdict, ...]:
    return tuple(
        Verdict(
            composite=c.name,
            kind=c.kind,
            ok=p is None,
            reason=(f"{p.status}: {p.evidence}" if p is not None else "valid; ranked below the choice"),
        )
        for c, p in judged
        if c.name != chosen.name
    )


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise SelectionError(f"unknown dtype {value!r}; use a torch dtype name such as float32, float64, int64, bool")
    return dtype


class Selector:
    """The decisions of one op table (``Registry.selector``): which composite runs in a context, and why.

    It holds what the decisions read and keep: the op table (its composites, rules, preferences and size
    signatures), the evidence slot (``registry.core.evidence``), and a bounded cache of decisions (at most
    ``capacity``, the oldest goes first) with its generation, bumped by ``clear()`` on every change of composites or
    evidence and when the C++ kernels load (a decision made before judged the cpp_op kind without its ops), when the
    listeners (the router's tables of either backend) are told too. A decision made while the generation moved is
    returned but not kept.
    """

    def __init__(self, table: OpTable, evidence_slot: evidence.EvidenceSlot | None = None,
                 capacity: int = CACHE_SIZE) -> None:
        self.table = table
        self.evidence = evidence.EvidenceSlot() if evidence_slot is None else evidence_slot
        self.capacity = capacity
        self.cache: dict[tuple, Decision] = {}
        self.generation = 0
        self.lock = threading.Lock()
        self.listeners: list[Callable[[], None]] = []  # told after every clear(): the router's decision tables
        table.listeners.append(self.clear)
        self.evidence.listeners.append(self.clear)
        kernels.LOADED.add(self.clear)

    def clear(self) -> None:
        """Forget every cached decision (after composites are added or removed, or the evidence changed)."""
        with self.lock:
            self.generation += 1
            self.cache.clear()
        for listener in self.listeners:
            listener()

    def decide(self, op: str, ctx: Context, policy: str = "auto", pin: str | None = None) -> Decision:
        """The decision for ``op`` in ``ctx``: cached per (op, context, policy, pin)."""
        size = (ctx.numel or 1).bit_length()  # profiles are kept per power-of-two size
        # The batch size's bit length: a rule may read it (a loop over one sample is one call of PyTorch's kernel).
        # Each per-sample dimension's bit length, as the C++ routing key holds them: a rule may read the ranks and
        # which sizes are 1 (linear's weight must be 2-d; mm's outer products contract over one element).
        shapes = tuple(tuple(dim.bit_length() for dim in shape) for shape in ctx.shapes)
        key = (op, ctx.stack, ctx.batched, ctx.dtype, ctx.device, ctx.self_covers_batching, ctx.tensors, size,
               ctx.batch_size.bit_length(), policy, pin, self.table.signatures.bucket(op, ctx), ctx.given,
               ctx.native_batch_rules, shapes)
        cache = self.cache
        decision = cache.get(key)
        if decision is not None:
            return decision
        generation = self.generation
        decision = self.decide_uncached(op, ctx, policy, pin)
        with self.lock:
            if self.generation == generation:  # else the composites or the evidence changed meanwhile: not kept
                if len(cache) >= self.capacity:
                    del cache[next(iter(cache))]
                cache[key] = decision
        return decision

    def verdicts(self, op: str, ctx: Context, policy: str) -> tuple[Judged, dict[str, int]]:
        """Each composite's problem in ``ctx`` (rules, and for ``auto`` the verified matrix), and how many matrix
        entries speak for it there."""
        table, source = self.table, self.evidence.source
        judged, verified = [], {}
        tensor_args = table.ops[op].tensor_args
        for composite in table.composites[op].values():
            problem = rules.problem(op, composite.kind, ctx, table.op_rules)
            if policy in ("auto", "fastest"):
                measured, count = source.evidence(op, composite.name, ctx, tensor_args)
                verified[composite.name] = count
                if problem is None and measured is not None:
                    problem = rules.Problem(measured.status, f"measured: {measured.text}")
            judged.append((composite, problem))
        return judged, verified

    def resolve_pin(self, op: str, pin: str) -> Composite:
        composites = self.table.composites[op]
        if pin in composites:
            return composites[pin]
        by_kind = [c for c in composites.values() if c.kind == pin]
        if by_kind:
            return by_kind[0]
        raise SelectionError(
            f"pins[{op!r}] = {pin!r} names no composite or kind of {op}; registered: {', '.join(composites)}; "
            f"kinds: {', '.join(KINDS)}"
        )

    def choose(self, op: str, ctx: Context, policy: str, pin: str | None) -> Choice:
        """Which composite of ``op`` runs in ``ctx`` under ``policy`` (and ``pin``), and on what basis: the rules'
        verdicts, the measured evidence and timings, the shipped reference profiles. Raises SelectionError where nothing
        can be chosen."""
        table = self.table
        table.load()
        if op not in table.ops:
            raise SelectionError(unknown_op_message(op, table.ops))
        if policy not in POLICIES:
            raise SelectionError(f"select({op}): unknown policy {policy!r}; policies are {', '.join(POLICIES)}")
        judged, verified = self.verdicts(op, ctx, policy)
        base = {"op": op, "ctx": ctx, "policy": policy, "judged": judged, "verified": verified}

        if pin is not None:
            chosen = self.resolve_pin(op, pin)
            problem = dict((c.name, p) for c, p in judged)[chosen.name]
            # PyTorch's own op where it only loops is correct: a pin of it runs it (the loop, or this package's C++
            # batching rule where one applies), as the call does without use().
            only_loops = problem is not None and problem.status == "slow" and chosen.kind == NATIVE.name
            if problem is not None and not only_loops:
                valid = [c.name for c, p in judged if p is None]
                raise SelectionError(
                    f"select({op}): pinned composite {chosen.name} ({chosen.kind}) is not valid under "
                    f"{_describe(ctx)}: {problem.status}, {problem.evidence}; valid choices: "
                    f"{', '.join(valid) or 'none'}"
                )
            return Choice(**base, chosen=chosen, basis=PINNED, pin=pin)
        if policy == "native":
            return Choice(**base, chosen=next(c for c, _ in judged if c.kind == NATIVE.name), basis=POLICY_NATIVE)
        order = rules.preference(ctx, op, table.op_preferences)
        valid = [(c, p) for c, p in judged if p is None]
        if not valid:
            slow_native = next((c for c, p in judged if c.kind == NATIVE.name and p is not None and p.status == "slow"),
                               None)
            if slow_native is not None and policy in ("auto", "fastest"):
                # Only where no measurement says native does worse here than loop (errs, or is wrong).
                measured, _ = self.evidence.source.evidence(op, slow_native.name, ctx, table.ops[op].tensor_args)
                if measured is not None and measured.status != "slow":
                    slow_native = None
            if slow_native is not None:
                # PyTorch's own op runs here, in vmap's per-sample loop, with the right values: what the call
                # does without use(). Refusing it would break code that works natively (a function functionalized
                # automatically meets an op whose only batched composite is a primitive, which functionalize
                # cannot run).
                return Choice(**base, chosen=slow_native, basis=SLOW_NATIVE)
            listed = ", ".join(f"{c.name} [{p.status}]" for c, p in judged)
            raise SelectionError(
                f"select({op}): no composite is valid under {_describe(ctx)}; registered: {listed}. Register a "
                "functional or primitive composite, or run this op outside the transform"
            )
        costed = cost.choose(op, ctx, judged, policy, table.signatures.bucket(op, ctx), self.evidence.source,
                             table.ops[op].tensor_args, measured_only=table.signatures.measured_only(op))
        # (native or a composite by cost at the call's sizes)
        if costed is not None:
            return Choice(**base, chosen=table.composites[op][costed.composite], basis=COST, costed=costed,
                          speedup=costed.speedup)
        names = list(table.composites[op])
        chosen = min(valid, key=lambda item: (_rank(order, item[0].kind), names.index(item[0].name)))[0]
        skipped = tuple((c, p) for c, p in judged
                        if p is not None and _rank(order, c.kind) < _rank(order, chosen.kind))
        measured = (self.evidence.source.timings(op, ctx, [c.name for c, _ in judged])
                    if policy in ("auto", "fastest") else {})
        timed_valid = sorted((measured[c.name].score_us, c.name) for c, _ in valid if c.name in measured)
        if timed_valid:
            fastest = measured[timed_valid[0][1]]
            rules_choice = measured.get(chosen.name)
            within_noise = False
            if rules_choice is not None and rules_choice.composite != fastest.composite:
                # A profile only says the fastest is faster if it is by more than the noise of both timings: below that,
                # the rules' choice stays, so a noisy profile cannot flip a decision.
                band = max(MIN_NOISE, fastest.spread, rules_choice.spread)
                within_noise = rules_choice.score_us <= fastest.score_us * (1 + band)
            if not within_noise:
                chosen = table.composites[op][fastest.composite]
            best = measured[chosen.name]
            native = next((c.name for c, _ in judged if c.kind == NATIVE.name), None)
            others = [(score, name) for score, name in timed_valid if name != chosen.name]
            runner_up = others[0] if others else None
            return Choice(**base, chosen=chosen, basis=MEASURED, skipped=skipped, measured=measured, fastest=fastest,
                          within_noise=within_noise, runner_up=runner_up,
                          speedup=measured[native].score_us / best.score_us if native in measured else None,
                          runner_up_speedup=runner_up[0] / best.score_us if runner_up else None)
        # The reference reorders composites the matrix speaks for alike: where it verifies the rules' choice, only other
        # verified composites may replace it.
        alike = [(c, p) for c, p in valid if not verified.get(chosen.name, 0) or verified.get(c.name, 0)]
        shipped = _reference_choice(op, ctx, policy, chosen, alike)
        if shipped is not None:
            return Choice(**base, chosen=table.composites[op][shipped.fastest], basis=REFERENCE, skipped=skipped,
                          reference=shipped)
        return Choice(**base, chosen=chosen, basis=RULES, skipped=skipped,
                      order_reason=rules.preference_reason(ctx, op, table.op_preferences))


    def decide_uncached(self, op: str, ctx: Context, policy: str, pin: str | None) -> Decision:
        """The decision for ``op`` in ``ctx``, made now (``decide`` keeps it)."""
        choice = self.choose(op, ctx, policy, pin)
        chosen = choice.chosen
        kind = NATIVE.name if choice.basis == SLOW_NATIVE else chosen.kind
        loops = choice.basis == SLOW_NATIVE or (choice.basis == COST and kind == NATIVE.name)
        return Decision(op=op, composite=chosen.name, kind=kind, reason=explain(choice) + ".",
                        alternatives=_alternatives(choice.judged, chosen), context=ctx, policy=policy,
                        speedup=choice.speedup, runner_up_speedup=choice.runner_up_speedup, native_loops=loops,
                        function=chosen.fn)


    def select(
        self,
        op: str,
        *,
        stack: str | Iterable[str] = (),
        batched: Iterable[str] = (),
        dtype: torch.dtype | str | None = None,
        device: str | None = None,
        numel: int | None = None,
        policy: str = "auto",
        pins: Mapping[str, str] | None = None,
        tensors: Iterable[str] | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
        batch_size: int = 1,
        native_batch_rules: bool = False,
    ) -> Decision:
        """Which composite of ``op`` runs under ``stack`` (``"vmap(grad)"``, ``"vmap,grad"`` or a sequence), and why.

        ``batched`` names the tensor arguments batched at the innermost vmap; ``tensors`` the arguments that are tensors
        (default: all of the op's tensor parameters, the Tensor overloads; with ``shapes``, the ones it names).
        ``shapes`` (each tensor argument's per-sample shape) and ``batch_size`` (the samples the first one stands
        for) are the call's sizes, which an op with a size signature is decided by (registry.core.cost);
        ``native_batch_rules``: whether this package's C++ batching rules would serve PyTorch's kernel there (the
        C++ routing backend, a policy other than native).
        """
        self.table.load()
        ops = self.table.ops
        if op not in ops:
            raise SelectionError(unknown_op_message(op, ops))
        try:
            parsed = parse_stack(stack)
        except ValueError as error:
            raise SelectionError(f"select({op}): {error}") from None
        params = ops[op].tensor_args
        batched_names = tuple(batched)
        unknown = [name for name in batched_names if name not in params]
        if unknown:
            raise SelectionError(
                f"select({op}): batched names {', '.join(unknown)} are not tensor arguments of {op}; "
                f"its tensor arguments are {', '.join(params)}"
            )
        if batched_names and "vmap" not in parsed:
            raise SelectionError(f"select({op}): batched={','.join(batched_names)} needs vmap in the stack")
        if tensors is not None:
            tensor_names = tuple(tensors)
        elif shapes is not None:
            tensor_names = tuple(name for name in params if name in shapes)
        else:
            tensor_names = params
        sized = _per_sample_shapes(op, params, tensor_names, shapes, batch_size)
        ctx = Context(
            stack=parsed,
            batched=tuple(name for name in params if name in batched_names),
            dtype=_dtype(dtype),
            device=device,
            numel=numel,
            self_covers_batching=not batched_names or "self" in batched_names,
            tensors=tensor_names,
            shapes=sized,
            batch_size=batch_size,
            native_batch_rules=native_batch_rules,
        )
        pin = (pins or {}).get(op)
        return self.decide(op, ctx, policy, pin)


def _per_sample_shapes(op: str, params: tuple[str, ...], tensor_names: tuple[str, ...],
                       shapes: Mapping[str, Sequence[int]] | None, batch_size: int) -> tuple[tuple[int, ...], ...]:
    """``shapes`` in ``tensor_names``' order, checked: every name a tensor argument given, every size a natural
    number (SelectionError says which is not)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise SelectionError(f"select({op}): batch_size must be a natural number of samples, not {batch_size!r}")
    if shapes is None:
        return ()
    unknown = [name for name in shapes if name not in tensor_names]
    if unknown:
        raise SelectionError(f"select({op}): shapes names {', '.join(unknown)}, which are not tensor arguments given "
                             f"here; its tensor arguments are {', '.join(params)}")
    missing = [name for name in tensor_names if name not in shapes]
    if missing:
        raise SelectionError(f"select({op}): shapes has no per-sample shape for {', '.join(missing)}; give one for "
                             "every tensor argument, or leave shapes out")
    sized = []
    for name in tensor_names:
        shape = tuple(shapes[name])
        if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
            raise SelectionError(f"select({op}): the shape of {name} must be natural numbers, not {list(shape)!r}")
        sized.append(shape)
    return tuple(sized)


# The default registry's selector: of the default op table, reading the default evidence slot.
SELECTOR = Selector(TABLE, evidence.SLOT)


def clear_cache() -> None:
    """Forget every decision of the default registry (after composites are added or removed, or the evidence
    changed)."""
    SELECTOR.clear()


def decide(op: str, ctx: Context, policy: str = "auto", pin: str | None = None) -> Decision:
    """The default registry's decision for ``op`` in ``ctx`` (``Selector.decide``)."""
    return SELECTOR.decide(op, ctx, policy, pin)


def choose(op: str, ctx: Context, policy: str, pin: str | None) -> Choice:
    """The default registry's choice (``Selector.choose``), before any prose."""
    return SELECTOR.choose(op, ctx, policy, pin)


def select(
    op: str,
    *,
    stack: str | Iterable[str] = (),
    batched: Iterable[str] = (),
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
    numel: int | None = None,
    policy: str = "auto",
    pins: Mapping[str, str] | None = None,
    tensors: Iterable[str] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    batch_size: int = 1,
    native_batch_rules: bool = False,
) -> Decision:
    """Which composite of ``op`` runs under ``stack`` (``"vmap(grad)"``, ``"vmap,grad"`` or a sequence), and why:
    ``Selector.select`` of the default registry."""
    return SELECTOR.select(op, stack=stack, batched=batched, dtype=dtype, device=device, numel=numel, policy=policy,
                           pins=pins, tensors=tensors, shapes=shapes, batch_size=batch_size,
                           native_batch_rules=native_batch_rules)
