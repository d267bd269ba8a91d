"""Run an op under a named transform stack and compare it with a Python loop over the batch calling native PyTorch
outside any transform: the evidence behind every claim that a composite works somewhere."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from registry.core.messages import described
from registry.core.ops import ORIGINAL
from registry.core.routing import use
from registry.harness import fallback
from registry.harness.comparison import compare
from registry.harness.interpreter import Layout, differentiates, program, reference, transformed
from registry.harness.outcomes import Outcome
from registry.harness.samples import Args, Sample

STACKS: tuple[str, ...] = (
    "vmap", "grad", "vmap(grad)", "grad(vmap)", "jacrev", "jacfwd", "vmap(jacfwd)", "hessian", "vmap(vmap)",
    "functionalize", "compile",
)
GRAD_STACKS = frozenset(stack for stack in STACKS if differentiates(program(stack)))
PATTERNS: tuple[str, ...] = ("self", "others", "in_dims1")

Call = Callable[[Args], Any]


def entry_call(op: str, sample: Sample, *, entry: str = "method") -> Call:
    """Call ``op`` through a public entry point, as users do (inside ``use()`` the dispatcher routes it)."""

    def call(args: Args) -> Any:
        positional = [value for name, value in args.items() if name not in sample.kwargs]
        keywords = {name: args[name] for name in sample.kwargs if name in args}
        if entry == "function":
            return getattr(torch, op)(*positional, **keywords)
        return getattr(torch.Tensor, op)(*positional, **keywords)

    return call


def native_call(op: str, sample: Sample) -> Call:
    """PyTorch's own op, called outside any transform with routing off (``use(policy="native")``, which counts when
    a check runs inside ``use()``): the reference.

    index_fill gets its negative indices made non-negative (the same function): PyTorch's own derivative formulas
    fail on negative indices, and the reference must not.
    """

    def call(args: Args) -> Any:
        if op == "index_fill" and args["self"].dim() and not isinstance(args["index"], list):
            args = {**args, "index": args["index"] % args["self"].shape[args["dim"]]}
        positional = [value for name, value in args.items() if name not in sample.kwargs]
        keywords = {name: args[name] for name in sample.kwargs if name in args}
        with use(policy="native"):
            return getattr(ORIGINAL.Tensor, op)(*positional, **keywords)

    return call


def skip_reason(sample: Sample, stack: str, pattern: str) -> str | None:
    if stack in GRAD_STACKS and not sample.differentiable:
        return f"{sample.dtype} has no gradients"
    if pattern == "others" and not set(sample.batchable) - {"self"}:
        return f"{sample.op} has no tensor argument besides self"
    return None


def batched_names(sample: Sample, pattern: str) -> tuple[str, ...]:
    if pattern == "self":
        return ("self",)
    if pattern == "others":
        return tuple(name for name in sample.batchable if name != "self")
    return sample.batchable


class _Case:
    """One sample, one batching pattern: per-sample arguments, and the same arguments stacked for vmap."""

    def __init__(self, sample: Sample, pattern: str, batch: int, seed: int) -> None:
        self.sample = sample
        self.names = sample.batchable  # the function's tensor inputs, in order
        self.batched = batched_names(sample, pattern)
        self.base = sample.build(seed)
        self.per_sample: list[Args] = []
        for b in range(batch):
            fresh = sample.build(seed + 1 + b)
            self.per_sample.append({k: (fresh[k] if k in self.batched else v) for k, v in self.base.items()})
        self.in_dim = 1 if pattern == "in_dims1" else 0
        self.argnums = tuple(self.names.index(name) for name in sample.differentiable)

    def dim_for(self, name: str) -> int | None:
        if name not in self.batched:
            return None
        return self.in_dim if self.base[name].dim() >= 1 else 0

    @property
    def in_dims(self) -> tuple[int | None, ...]:
        return tuple(self.dim_for(name) for name in self.names)

    def stacked(self, per_sample: Sequence[Args]) -> tuple[Any, ...]:
        out = []
        for name in self.names:
            dim = self.dim_for(name)
            out.append(self.base[name] if dim is None else torch.stack([a[name] for a in per_sample], dim))
        return tuple(out)

    def stacked_twice(self) -> tuple[Any, ...]:
        """Two outer rows of the stacked samples, for vmap(vmap)."""
        rows = [self.stacked(self.per_sample) for _ in range(2)]
        return tuple(self.base[name] if self.dim_for(name) is None else torch.stack([row[i] for row in rows],
                                                                                     self.dim_for(name))
                     for i, name in enumerate(self.names))

    def inputs(self, args: Args) -> tuple[Any, ...]:
        return tuple(args[name] for name in self.names)

    def function(self, call: Call) -> Callable[..., Any]:
        def f(*tensors: Any) -> Any:
            args = dict(self.base)
            args.update(zip(self.names, tensors, strict=True))
            return call(args)

        return f


def _program(stack: str) -> tuple[str, ...]:
    """The interpreter's layers of a named stack; ``compile`` compiles the vmapped op."""
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r}; stacks are {', '.join(STACKS)}")
    layers = program(stack)
    return ("compile", "vmap") if layers == ("compile",) else layers


def _run(stack: str, case: _Case, call: Call, native: Call, weight: torch.Tensor | None,
         counted: tuple[fallback.KernelCalls, fallback.KernelCalls] | None = None) -> tuple[Any, Any]:
    """(actual, expected) for ``stack``; ``weight`` shapes the scalar loss ``sum(weight * y * y)`` of the gradient
    stacks. A stack without vmap runs per sample, and so does its reference. ``counted``: the modes that count the
    kernel calls of the transformed call and of the reference loop (a vmap stack's)."""
    layers = _program(stack)
    vmaps = layers.count("vmap")
    layout = Layout(in_dims=(case.in_dims,) * vmaps, wrt=case.argnums, loss=lambda y: (weight * y * y).sum())
    f, native_f = case.function(call), case.function(native)
    if not vmaps:
        actual = [transformed(layers, f, layout)(*case.inputs(a)) for a in case.per_sample]
        return actual, [reference(layers, native_f, layout)(*case.inputs(a)) for a in case.per_sample]
    inputs = case.stacked(case.per_sample) if vmaps == 1 else case.stacked_twice()
    if counted is None:
        return transformed(layers, f, layout)(*inputs), reference(layers, native_f, layout)(*inputs)
    with counted[0]:
        actual = transformed(layers, f, layout)(*inputs)
    with counted[1]:
        return actual, reference(layers, native_f, layout)(*inputs)


def _samples(stack: str, batch: int) -> int:
    """How many samples a vmap stack's reference loops over (vmap(vmap): two rows of ``batch``)."""
    return batch * 2 if _program(stack).count("vmap") > 1 else batch


def check(sample: Sample, stack: str, pattern: str, call: Call | None = None, *, batch: int = 3,
          seed: int = 0, count_loops: bool = False) -> Outcome:
    """Run ``call`` (default: the op's method entry point) under ``stack`` and compare with the native loop.

    ``count_loops`` (for PyTorch's own op, outside ``use()``): a vmap stack's call also counts as slow where it ran
    the op once per sample without vmap's warning (``fallback.silent_loop_note``). Off by default: the counting is a
    Python dispatch mode, which a routed call inside ``use()`` must not run under."""
    call = call or entry_call(sample.op, sample)
    native = native_call(sample.op, sample)
    case = _Case(sample, pattern, batch, seed)
    weight = None
    if stack in GRAD_STACKS:
        y0 = native(case.base)
        weight = torch.randn(y0.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        weight = weight.to(y0.dtype)
    layers = _program(stack)
    counted = ((fallback.KernelCalls(), fallback.KernelCalls())
               if count_loops and "vmap" in layers and "compile" not in layers else None)
    with fallback.watch() as caught:
        try:
            actual, expected = _run(stack, case, call, native, weight, counted)
        except Exception as error:  # the outcome of an op under a transform is data here, not a crash
            return Outcome("error", described(error))
    if (problem := compare(actual, expected)) is not None:
        return Outcome("mismatch", problem.detail, problem.max_abs_error, problem.max_rel_error)
    if (note := fallback.fallback_note(caught)) is not None:
        return Outcome("slow", note)
    if counted is not None and (note := fallback.silent_loop_note(sample.op, *counted, _samples(stack, batch))):
        return Outcome("slow", note)
    return Outcome("ok")
