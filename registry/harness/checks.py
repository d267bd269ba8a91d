"""Run an op under a named transform stack and compare it with a Python loop over the batch calling native PyTorch
outside any transform: the evidence behind every claim that a composite works somewhere."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import func

from registry.core.messages import described
from registry.core.ops import ORIGINAL
from registry.core.routing import use
from registry.harness.samples import Args, Sample

STACKS: tuple[str, ...] = (
    "vmap", "grad", "vmap(grad)", "grad(vmap)", "jacrev", "jacfwd", "vmap(jacfwd)", "hessian", "vmap(vmap)",
    "functionalize", "compile",
)
GRAD_STACKS = frozenset({"grad", "vmap(grad)", "grad(vmap)", "jacrev", "jacfwd", "vmap(jacfwd)", "hessian"})
PATTERNS: tuple[str, ...] = ("self", "others", "in_dims1")
FALLBACK_WARNING = "There is a performance drop"

Call = Callable[[Args], Any]


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | slow | error | mismatch
    detail: str = ""


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

    def inputs(self, args: Args) -> tuple[Any, ...]:
        return tuple(args[name] for name in self.names)

    def function(self, call: Call) -> Callable[..., Any]:
        def f(*tensors: Any) -> Any:
            args = dict(self.base)
            args.update(zip(self.names, tensors, strict=True))
            return call(args)

        return f


def _loss(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight * y * y).sum()


def _reference_grads(native: Call, case: _Case, args: Args, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = {name: args[name].detach().clone().requires_grad_() for name in case.sample.differentiable}
    y = native({**args, **leaves})
    return torch.autograd.grad(_loss(y, weight), tuple(leaves.values()), allow_unused=True, materialize_grads=True)


def _reference_jacobian(native: Call, case: _Case, args: Args, forward: bool = False) -> tuple[torch.Tensor, ...]:
    """The Jacobian row by row with ``torch.autograd.grad``; ``forward`` gives it the output's dtype, as jacfwd does."""
    leaves = {name: args[name].detach().clone().requires_grad_() for name in case.sample.differentiable}
    y = native({**args, **leaves})
    rows: list[tuple[torch.Tensor, ...]] = []
    for element in y.reshape(-1):
        rows.append(torch.autograd.grad(element, tuple(leaves.values()), retain_graph=True, allow_unused=True,
                                        materialize_grads=True))
    jacobian = tuple(
        torch.stack([row[i] for row in rows]).reshape((*y.shape, *leaf.shape)) if rows
        else torch.zeros((*y.shape, *leaf.shape), dtype=leaf.dtype)
        for i, leaf in enumerate(leaves.values())
    )
    return tuple(j.to(y.dtype) for j in jacobian) if forward else jacobian


def _reference_hessian(native: Call, case: _Case, args: Args, weight: torch.Tensor):
    leaves = {name: args[name].detach().clone().requires_grad_() for name in case.sample.differentiable}
    xs = tuple(leaves.values())
    grads = torch.autograd.grad(_loss(native({**args, **leaves}), weight), xs, create_graph=True,
                                allow_unused=True, materialize_grads=True)
    hessian = []
    for g in grads:
        rows = [torch.autograd.grad(element, xs, retain_graph=True, allow_unused=True, materialize_grads=True)
                for element in g.reshape(-1)]
        hessian.append(tuple(
            torch.stack([row[j] for row in rows]).reshape((*g.shape, *x.shape)) if rows
            else torch.zeros((*g.shape, *x.shape), dtype=x.dtype)
            for j, x in enumerate(xs)
        ))
    return tuple(hessian)


def _stack_tree(trees: Sequence[Any], dim: int = 0) -> Any:
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(trees), dim)
    return type(first)(_stack_tree([t[i] for t in trees], dim) for i in range(len(first)))


def _compare(actual: Any, expected: Any, where: str = "output") -> str | None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{where}: expected a tensor, got {type(actual).__name__}"
        if actual.shape != expected.shape:
            return f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        if actual.dtype != expected.dtype:
            return f"{where}: dtype {actual.dtype} != {expected.dtype}"
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True)
        except AssertionError:
            diff = (actual.double() - expected.double()).abs()
            rel = diff / expected.double().abs().clamp_min(1e-12)
            return f"{where}: max abs error {diff.max().item():.3g}, max rel error {rel.max().item():.3g}"
        return None
    if len(actual) != len(expected):
        return f"{where}: {len(actual)} results != {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if (problem := _compare(a, e, f"{where}[{i}]")) is not None:
            return problem
    return None


def _run(stack: str, case: _Case, call: Call, native: Call, weight: torch.Tensor | None):
    """(actual, expected) for ``stack``; ``weight`` shapes the scalar loss of the gradient stacks."""
    f = case.function(call)
    per = case.per_sample
    argnums = case.argnums

    def loss_f(*t: Any) -> torch.Tensor:
        return _loss(f(*t), weight)

    if stack == "vmap":
        return func.vmap(f, case.in_dims)(*case.stacked(per)), torch.stack([native(a) for a in per])
    if stack == "vmap(vmap)":
        inner = [[{**a, **{k: v for k, v in b.items() if k in case.batched}} for b in per] for a in per[:2]]
        outer_inputs = []
        for name in case.names:
            dim = case.dim_for(name)
            if dim is None:
                outer_inputs.append(case.base[name])
            else:
                rows = [torch.stack([a[name] for a in row], dim) for row in inner]
                outer_inputs.append(torch.stack(rows, dim))
        actual = func.vmap(func.vmap(f, case.in_dims), case.in_dims)(*outer_inputs)
        return actual, torch.stack([torch.stack([native(a) for a in row]) for row in inner])
    if stack == "grad":
        actual = [func.grad(loss_f, argnums)(*case.inputs(a)) for a in per]
        return actual, [_reference_grads(native, case, a, weight) for a in per]
    if stack == "vmap(grad)":
        actual = func.vmap(func.grad(loss_f, argnums), case.in_dims)(*case.stacked(per))
        return actual, _stack_tree([_reference_grads(native, case, a, weight) for a in per])
    if stack == "grad(vmap)":
        batched_f = func.vmap(f, case.in_dims)
        actual = func.grad(lambda *t: _loss(batched_f(*t), weight), argnums)(*case.stacked(per))
        refs = [_reference_grads(native, case, a, weight) for a in per]
        expected = []
        for i, name in enumerate(case.sample.differentiable):
            dim = case.dim_for(name)
            parts = [r[i] for r in refs]
            expected.append(torch.stack(parts).sum(0) if dim is None else torch.stack(parts, dim))
        return actual, tuple(expected)
    if stack in ("jacrev", "jacfwd"):
        transform = func.jacrev if stack == "jacrev" else func.jacfwd
        actual = [transform(f, argnums)(*case.inputs(a)) for a in per]
        return actual, [_reference_jacobian(native, case, a, stack == "jacfwd") for a in per]
    if stack == "vmap(jacfwd)":
        actual = func.vmap(func.jacfwd(f, argnums), case.in_dims)(*case.stacked(per))
        return actual, _stack_tree([_reference_jacobian(native, case, a, True) for a in per])
    if stack == "hessian":
        actual = [func.hessian(loss_f, argnums)(*case.inputs(a)) for a in per]
        return actual, [_reference_hessian(native, case, a, weight) for a in per]
    if stack == "functionalize":
        return [func.functionalize(f)(*case.inputs(a)) for a in per], [native(a) for a in per]
    if stack == "compile":
        torch._dynamo.reset()  # every case compiles the same vmap wrapper: without a reset it hits the recompile limit
        compiled = torch.compile(func.vmap(f, case.in_dims), backend="aot_eager", fullgraph=True)
        return compiled(*case.stacked(per)), torch.stack([native(a) for a in per])
    raise ValueError(f"unknown stack {stack!r}; stacks are {', '.join(STACKS)}")


def check(sample: Sample, stack: str, pattern: str, call: Call | None = None, *, batch: int = 3,
          seed: int = 0) -> Outcome:
    """Run ``call`` (default: the op's method entry point) under ``stack`` and compare with the native loop."""
    call = call or entry_call(sample.op, sample)
    native = native_call(sample.op, sample)
    case = _Case(sample, pattern, batch, seed)
    weight = None
    if stack in GRAD_STACKS:
        y0 = native(case.base)
        weight = torch.randn(y0.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        weight = weight.to(y0.dtype)
    # PyTorch has no getter for this switch; it is off by default, and turned off again afterwards.
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                actual, expected = _run(stack, case, call, native, weight)
            except Exception as error:  # the outcome of an op under a transform is data here, not a crash
                return Outcome("error", described(error))
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    if (problem := _compare(actual, expected)) is not None:
        return Outcome("mismatch", problem)
    slow = [str(w.message) for w in caught if FALLBACK_WARNING in str(w.message)]
    if slow:
        return Outcome("slow", slow[0].splitlines()[0][:300])
    return Outcome("ok")
