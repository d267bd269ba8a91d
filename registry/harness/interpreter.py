"""The harness's interpreter of transform stacks: a function run under a stack through torch.func, and what it must
equal computed by native PyTorch outside any transform.

A stack is a program of layers, outermost first (``("vmap", "grad")`` for ``vmap(grad(f))``), spelled as the core
parser reads it (``registry.core.stacks.split_stack``: ``"vmap(grad)"`` or ``"vmap,grad"``). Each layer maps a
function of tensors to a function of tensors, so a stack is built, and its reference computed, by composing layers
from the innermost out:

============= ============================================= ===================================================
layer         under the transform (``transformed``)         the reference (``reference``)
============= ============================================= ===================================================
vmap          ``torch.func.vmap`` with the layer's in_dims   a Python loop over the batch, results stacked
grad          ``torch.func.grad`` of ``layout.loss``         ``torch.autograd.grad`` of the same loss
jvp           ``torch.func.jvp`` along ``layout.tangent``    ``forward_ad`` where it is the only differentiating
                                                             layer, else the double vjp J t = d/du <J^T u, t>
jacrev        ``torch.func.jacrev``                          the Jacobian row by row with ``autograd.grad``
jacfwd        ``torch.func.jacfwd``                          the same, in the output's dtype (as jacfwd gives it)
hessian       ``torch.func.hessian`` of ``layout.loss``      the Jacobian of the loss's ``autograd`` gradient
functionalize ``torch.func.functionalize``                   nothing
compile       ``torch.compile`` (aot_eager, fullgraph)       nothing
============= ============================================= ===================================================

The differentiating layers differentiate with respect to ``layout.wrt`` (one argument: one result; a tuple: a tuple
of results, as torch.func's ``argnums``); an argument may be a pytree of tensors (a dict of parameters), whose
result has its structure, and a vmap layer's loop takes each batched tensor of a pytree argument's sample. A
reference layer keeps its graph (``create_graph``) only where a layer outside it differentiates again.

Used by ``checks`` (the test suite's named stacks), ``verify`` (the matrix's generated stacks), the profiles'
workloads, and ``case_stacks`` (the OpInfo cases of the survey, the conformance suite and the matrix's OpInfo ops:
their stacks, and the gradients and jvps of their per-sample reference). Results are compared with
``registry.harness.comparison``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import func
from torch.autograd import forward_ad
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: PLC2701 - PyTorch's pytree

from registry.core.stacks import format_stack, split_stack

LAYERS: tuple[str, ...] = ("vmap", "grad", "jvp", "jacrev", "jacfwd", "hessian", "functionalize", "compile")
DIFFERENTIATING = frozenset({"grad", "jvp", "jacrev", "jacfwd", "hessian"})

Fn = Callable[..., Any]


def program(stack: str | Sequence[str]) -> tuple[str, ...]:
    """A stack's layers, outermost first, from either spelling or a sequence of names; raises ValueError naming the
    layers for an unknown one."""
    names = split_stack(stack) if isinstance(stack, str) else [name.strip() for name in stack]
    unknown = [name for name in names if name not in LAYERS]
    if unknown:
        raise ValueError(f"unknown layer {unknown[0]!r} in stack {format_stack(names)!r}; layers are "
                         f"{', '.join(LAYERS)}")
    return tuple(names)


def differentiates(stack: Sequence[str]) -> bool:
    return any(layer in DIFFERENTIATING for layer in stack)


def linspace_weight(y: torch.Tensor) -> torch.Tensor:
    """Deterministic weights built from the shape alone: the same under any transform and in the reference."""
    return torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)


def weighted_square(y: torch.Tensor) -> torch.Tensor:
    """``sum(w * y * y)`` with ``linspace_weight``: a loss whose gradient depends on every output element."""
    return (linspace_weight(y) * y * y).sum()


def linspace_tangent(x: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, x.numel(), dtype=x.dtype, device=x.device).reshape(x.shape)


@dataclass(frozen=True)
class Layout:
    """How a stack sees its function's inputs: per vmap layer (outermost first) each input's batch dim or None;
    what the differentiating layers differentiate (``wrt``), the scalar that grad and hessian differentiate
    (``loss``) and the tangent jvp pushes forward from an input (``tangent``; None: the function's last
    ``len(wrt)`` arguments are the tangents, so that vmap can batch them). ``with_primal``: jvp gives
    (outputs, tangents), as ``torch.func.jvp`` does, rather than the tangents alone. ``forward_ad``: the jvp
    reference is forward AD (True) or the double vjp (False, independent of the op's forward-mode formula); None:
    forward AD exactly where jvp is the stack's one differentiating layer."""

    in_dims: tuple[tuple[int | None, ...], ...] = ()
    wrt: int | tuple[int, ...] = 0
    loss: Callable[[Any], torch.Tensor] = field(default=weighted_square)
    tangent: Callable[[torch.Tensor], torch.Tensor] | None = field(default=linspace_tangent)
    with_primal: bool = False
    forward_ad: bool | None = None

    @property
    def argnums(self) -> tuple[int, ...]:
        return (self.wrt,) if isinstance(self.wrt, int) else self.wrt

    def split_tangents(self, args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(the function's inputs, the jvp's tangents) of a jvp layer's arguments."""
        if self.tangent is not None:
            return tuple(args), tuple(self.tangent(args[i]) for i in self.argnums)
        split = len(args) - len(self.argnums)
        return tuple(args[:split]), tuple(args[split:])

    def result(self, per_argument: Sequence[Any]) -> Any:
        """One result per differentiated argument, shaped as torch.func shapes it for ``wrt``."""
        return per_argument[0] if isinstance(self.wrt, int) else tuple(per_argument)


def _vmap_layers(stack: Sequence[str], layout: Layout) -> int:
    count = sum(1 for layer in stack if layer == "vmap")
    if count > len(layout.in_dims):
        raise ValueError(f"stack {format_stack(stack)!r} has {count} vmap layers; the layout gives in_dims for "
                         f"{len(layout.in_dims)}")
    return count


def _replaced(xs: Sequence[Any], argnums: Sequence[int], values: Sequence[Any]) -> tuple[Any, ...]:
    out = list(xs)
    for i, value in zip(argnums, values, strict=True):
        out[i] = value
    return tuple(out)


# --- under the transforms -------------------------------------------------------------------------------------------


def transformed(stack: Sequence[str], f: Fn, layout: Layout) -> Fn:
    """``f`` under ``stack`` (layers outermost first) through torch.func."""
    vmap_layer = _vmap_layers(stack, layout)
    for layer in reversed(stack):
        if layer == "vmap":
            vmap_layer -= 1
            f = func.vmap(f, layout.in_dims[vmap_layer])
        elif layer == "grad":
            f = _func_grad(f, layout)
        elif layer == "jvp":
            f = _func_jvp(f, layout)
        elif layer == "jacrev":
            f = func.jacrev(f, argnums=layout.wrt)
        elif layer == "jacfwd":
            f = func.jacfwd(f, argnums=layout.wrt)
        elif layer == "hessian":
            f = _func_hessian(f, layout)
        elif layer == "functionalize":
            f = func.functionalize(f)
        elif layer == "compile":
            torch._dynamo.reset()  # each case compiles the same wrappers: without a reset they hit the limit
            f = torch.compile(f, backend="aot_eager", fullgraph=True)
        else:
            raise ValueError(f"unknown layer {layer!r}; layers are {', '.join(LAYERS)}")
    return f


def _func_grad(f: Fn, layout: Layout) -> Fn:
    return func.grad(lambda *xs: layout.loss(f(*xs)), argnums=layout.wrt)


def _func_hessian(f: Fn, layout: Layout) -> Fn:
    return func.hessian(lambda *xs: layout.loss(f(*xs)), argnums=layout.wrt)


def _func_jvp(f: Fn, layout: Layout) -> Fn:
    argnums = layout.argnums

    def jvp_f(*args: Any) -> Any:
        xs, tangents = layout.split_tangents(args)

        def along(*ds: Any) -> Any:
            return f(*_replaced(xs, argnums, ds))

        outputs = func.jvp(along, tuple(xs[i] for i in argnums), tangents)
        return outputs if layout.with_primal else outputs[1]

    return jvp_f


# --- the reference, outside any transform ---------------------------------------------------------------------------


def reference(stack: Sequence[str], f: Fn, layout: Layout) -> Fn:
    """What ``transformed(stack, f, layout)`` must equal, with ``f`` computed outside any transform."""
    vmap_layer = _vmap_layers(stack, layout)
    # Forward AD has one level and does not mix reliably with reverse mode around or inside it: it is the reference
    # only for a jvp that is the stack's one differentiating layer; otherwise the double-vjp identity is.
    alone = sum(1 for layer in stack if layer in DIFFERENTIATING) == 1
    for depth in reversed(range(len(stack))):
        layer = stack[depth]
        outer = differentiates(stack[:depth])  # a layer outside this one differentiates its result again
        if layer == "vmap":
            vmap_layer -= 1
            f = _loop(f, layout.in_dims[vmap_layer])
        elif layer == "grad":
            f = _autograd_grad(f, layout, outer)
        elif layer == "jvp":
            forward = alone if layout.forward_ad is None else layout.forward_ad
            f = _forward_ad_jvp(f, layout) if forward else _autograd_jvp(f, layout)
        elif layer in ("jacrev", "jacfwd"):
            f = _autograd_jacobian(f, layout, outer, forward=layer == "jacfwd")
        elif layer == "hessian":
            f = _autograd_jacobian(_autograd_grad(f, layout, True), layout, outer, forward=True)
        elif layer not in ("functionalize", "compile"):
            raise ValueError(f"unknown layer {layer!r}; layers are {', '.join(LAYERS)}")
    return f


def stack_tree(trees: Sequence[Any], dim: int = 0) -> Any:
    """Tensors stacked along ``dim``, or tuples, lists and dicts of them stacked element by element."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(trees), dim)
    if isinstance(first, dict):
        return type(first)((key, stack_tree([t[key] for t in trees], dim)) for key in first)
    return type(first)(stack_tree([t[i] for t in trees], dim) for i in range(len(first)))


def _batched_size(x: Any, d: int) -> int:
    return next(t.shape[d] for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def _sample(x: Any, d: int, b: int) -> Any:
    """Sample ``b`` of ``x`` along ``d``: a tensor, or every tensor of a pytree (a dict of parameters), as vmap
    batches an argument's leaves."""
    return tree_map(lambda t: t.select(d, b) if isinstance(t, torch.Tensor) else t, x)


def _loop(f: Fn, in_dims: tuple[int | None, ...]) -> Fn:
    def looped(*xs: Any) -> Any:
        size = next(_batched_size(x, d) for x, d in zip(xs, in_dims, strict=True) if d is not None)
        return stack_tree([
            f(*(x if d is None else _sample(x, d, b) for x, d in zip(xs, in_dims, strict=True))) for b in range(size)
        ])

    return looped


def _leaf(x: torch.Tensor) -> torch.Tensor:
    # A copy: an op that writes to its input must not change the caller's samples.
    return x if x.requires_grad else x.detach().clone().requires_grad_()


@dataclass(frozen=True)
class _Differentiated:
    """The differentiated arguments made autograd leaves: each argument a tensor or a pytree of them (a dict of
    parameters, as torch.func differentiates it), and all their tensors in one flat tuple for ``autograd.grad``."""

    flat: tuple[torch.Tensor, ...]
    specs: tuple[Any, ...]
    counts: tuple[int, ...]

    def per_argument(self, flat_results: Sequence[Any]) -> list[Any]:
        """Flat results (one per tensor of ``flat``) regrouped as the arguments are: a tensor, or the pytree."""
        grouped, start = [], 0
        for spec, count in zip(self.specs, self.counts, strict=True):
            grouped.append(tree_unflatten(list(flat_results[start:start + count]), spec))
            start += count
        return grouped


def _leaves(xs: Sequence[Any], layout: Layout) -> tuple[tuple[Any, ...], _Differentiated]:
    """The inputs with the differentiated ones made autograd leaves (where no outer layer made them so), and those."""
    made, flat, specs, counts = [], [], [], []
    for i in layout.argnums:
        tensors, spec = tree_flatten(xs[i])
        leaves = [_leaf(t) for t in tensors]
        made.append(tree_unflatten(leaves, spec))
        flat.extend(leaves)
        specs.append(spec)
        counts.append(len(leaves))
    return _replaced(xs, layout.argnums, made), _Differentiated(tuple(flat), tuple(specs), tuple(counts))


def _autograd_grad(f: Fn, layout: Layout, create_graph: bool) -> Fn:
    def grad_f(*xs: Any) -> Any:
        inputs, leaves = _leaves(xs, layout)
        loss = layout.loss(f(*inputs))
        if not loss.requires_grad:  # an inner derivative of a linear op: constant in x
            return layout.result(leaves.per_argument([torch.zeros_like(leaf) for leaf in leaves.flat]))
        grads = torch.autograd.grad(loss, leaves.flat, create_graph=create_graph, allow_unused=True,
                                    materialize_grads=True)
        return layout.result(leaves.per_argument(grads))

    return grad_f


def _outputs(y: Any) -> tuple[torch.Tensor, ...]:
    return (y,) if isinstance(y, torch.Tensor) else tuple(y)


def _autograd_jacobian(f: Fn, layout: Layout, create_graph: bool, *, forward: bool) -> Fn:
    """The Jacobian (per output, per differentiated argument, as torch.func nests them) row by row with
    ``torch.autograd.grad``; ``forward`` gives it the output's dtype, as jacfwd does."""

    def jacobian_f(*xs: Any) -> Any:
        inputs, differentiated = _leaves(xs, layout)
        leaves = differentiated.flat
        y = f(*inputs)
        per_output = []
        for out in _outputs(y):
            rows = [torch.autograd.grad(element, leaves, retain_graph=True, create_graph=create_graph,
                                        allow_unused=True, materialize_grads=True)
                    if element.requires_grad else tuple(torch.zeros_like(leaf) for leaf in leaves)
                    for element in out.reshape(-1)]
            blocks = [torch.stack([row[i] for row in rows]).reshape((*out.shape, *leaf.shape)) if rows
                      else torch.zeros((*out.shape, *leaf.shape), dtype=leaf.dtype)
                      for i, leaf in enumerate(leaves)]
            blocks = [b.to(out.dtype) for b in blocks] if forward else blocks
            per_output.append(layout.result(differentiated.per_argument(blocks)))
        return per_output[0] if isinstance(y, torch.Tensor) else type(y)(per_output)

    return jacobian_f


def _forward_ad_jvp(f: Fn, layout: Layout) -> Fn:
    def jvp_f(*args: Any) -> Any:
        xs, tangents = layout.split_tangents(args)
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(xs[i].detach().clone(), t)
                     for i, t in zip(layout.argnums, tangents, strict=True)]
            y = f(*_replaced(xs, layout.argnums, duals))
            unpacked = [forward_ad.unpack_dual(out) for out in _outputs(y)]
            primals = [u.primal.clone() for u in unpacked]
            pushed = [torch.zeros_like(u.primal) if u.tangent is None else u.tangent.clone() for u in unpacked]
        return _jvp_result(y, primals, pushed, layout)

    return jvp_f


def _autograd_jvp(f: Fn, layout: Layout) -> Fn:
    """J t as d/du <J^T u, t>: the vjp is linear in u, so its vjp with t is the jvp, through reverse mode only."""

    def jvp_f(*args: Any) -> Any:
        xs, tangents = layout.split_tangents(args)
        inputs, differentiated = _leaves(xs, layout)
        leaves = differentiated.flat
        y = f(*inputs)
        outputs = _outputs(y)
        if not any(out.requires_grad for out in outputs):  # an inner derivative of a linear op: constant in x
            return _jvp_result(y, outputs, [torch.zeros_like(out) for out in outputs], layout)
        cotangents = tuple(torch.zeros_like(out, requires_grad=True) for out in outputs)
        vjps = torch.autograd.grad(outputs, leaves, cotangents, create_graph=True, allow_unused=True,
                                   materialize_grads=True)
        used = [(g, t) for g, t in zip(vjps, tangents, strict=True) if g.requires_grad]
        if used:
            pushed = torch.autograd.grad([g for g, _ in used], cotangents, [t for _, t in used], create_graph=True,
                                         allow_unused=True, materialize_grads=True)
        else:  # the vjp does not depend on u: J is zero
            pushed = tuple(torch.zeros_like(out) for out in outputs)
        return _jvp_result(y, outputs, pushed, layout)

    return jvp_f


def _jvp_result(y: Any, primals: Sequence[torch.Tensor], pushed: Sequence[torch.Tensor], layout: Layout) -> Any:
    """The pushed-forward tangents shaped as ``y`` (a tensor, or a tuple of them), with ``y`` where asked."""
    if isinstance(y, torch.Tensor):
        return (primals[0], pushed[0]) if layout.with_primal else pushed[0]
    return (type(y)(primals), type(y)(pushed)) if layout.with_primal else type(y)(pushed)
