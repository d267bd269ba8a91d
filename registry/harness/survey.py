"""The survey: every OpInfo entry of PyTorch's ``op_db`` under the matrix's transform stacks, natively and inside
``registry.use()``, against a per-sample loop of native PyTorch outside any transform.

It measures coverage and finds what to cover next. One case is one OpInfo ``SampleInput`` (input, args, kwargs),
one batching variant (``input``: batch the tensors of ``sample.input``; ``others``: batch the tensors among the other
arguments), one dtype and one stack. The reference never runs under a transform: values are a Python loop over the
per-sample arguments, gradients ``torch.autograd.grad`` per sample, Jacobians one ``autograd.grad`` per output
element, and a jvp is that Jacobian times the tangent (so a wrong forward-mode formula shows as a mismatch).

The interpreter (``run_stack`` and ``reference``) sees a case only through ``SurveyCase``'s small interface: the
tensors a stack batches or differentiates, how to call the op on them, and the per-sample arguments. A case built from
the seed ops' samples (``registry.harness.samples``) can implement the same interface.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import math
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import func
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from registry.core.dynamic import REFUSAL_PHRASE
from registry.core.messages import described
from registry.core.stacks import canonical_workload
from registry.core.status import FAILING, RANK
from registry.harness.checks import FALLBACK_WARNING

SURVEY_STACKS: tuple[str, ...] = ("vmap", "grad", "vmap(grad)", "jacrev", "jacfwd", "vmap(jvp)")
# The interpreter runs these too (the conformance suite's checks): jvp alone, the vjp of a vmapped function and
# forward-over-reverse (the jvp of grad, a Hessian-vector product).
MORE_STACKS: tuple[str, ...] = ("jvp", "grad(vmap)", "jvp(grad)")
INTERPRETER_STACKS: tuple[str, ...] = SURVEY_STACKS + MORE_STACKS
BATCHINGS: tuple[str, ...] = ("input", "others")
DTYPES: tuple[str, ...] = ("float32", "float64")
# Over the samples of one row the worst status wins (RANK, registry.core.status: "unsupported" mildest).
MISBEHAVING: frozenset[str] = frozenset(FAILING)

DEFAULT_LIMIT_SAMPLES = 2
DEFAULT_BATCH = 3
DEFAULT_CASE_TIMEOUT_S = 20.0
SIZE_CAP = 512  # total elements of a sample's tensors: larger samples are used only when an entry has no smaller one
JACOBIAN_DIRECTIONS = 2  # random cotangents a Jacobian is projected on (see SurveyCase.directions)
SEED = 1234
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})
_VARIATION = 0.05  # per-sample float arguments: sample b is OpInfo's value scaled by 1 - b * this

# Stacks that differentiate, and which kind of derivative the op must support for them.
_REVERSE = frozenset({"grad", "vmap(grad)", "jacrev", "grad(vmap)", "jvp(grad)"})
_FORWARD = frozenset({"jacfwd", "vmap(jvp)", "jvp", "jvp(grad)"})
_BATCHED = frozenset({"vmap", "vmap(grad)", "vmap(jvp)", "grad(vmap)"})

# vmap's own words for what it cannot do by design rather than by a missing rule: not a coverage gap.
RANDOM_UNDER_VMAP = "random operation while in randomness error mode"  # vmap's refusal of a random op
_UNSUPPORTED_MESSAGES: tuple[tuple[str, str], ...] = (
    ("batching operators that can output dynamic shape", "dynamic shape op"),
    ("batching operators that can support dynamic shape", "dynamic shape op (boolean mask indexing)"),
    (RANDOM_UNDER_VMAP, "random op (vmap randomness='error')"),
    (REFUSAL_PHRASE, "dynamic shape op (refused inside use(), naming the fixed-shape alternative)"),
)


class SurveyError(ValueError):
    """Bad survey input: an unknown op, stack, batching variant or dtype."""


@dataclass(frozen=True)
class Outcome:
    status: str  # one of RANK
    detail: str = ""
    max_abs_error: float | None = None
    max_rel_error: float | None = None


@dataclass
class SurveyRow:
    """One op_db entry under one stack, batching variant and dtype: native's worst status over the samples, and the
    worst status inside ``registry.use()``."""

    op: str  # the op_db entry: its name, ".variant" appended when the entry has a variant_test_name
    opinfo_name: str
    variant_test_name: str
    stack: str
    batching: str
    dtype: str
    native_status: str
    native_detail: str
    use_status: str
    use_detail: str
    max_abs_error: float | None
    max_rel_error: float | None
    samples: int
    torch_version: str
    timestamp: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SurveyConfig:
    stacks: tuple[str, ...] = SURVEY_STACKS
    batchings: tuple[str, ...] = BATCHINGS
    limit_samples: int = DEFAULT_LIMIT_SAMPLES
    batch: int = DEFAULT_BATCH
    case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S
    inside_use: bool = True


def entry_id(opinfo: Any) -> str:
    """``name`` or ``name.variant``: how the survey and its CLI name an op_db entry."""
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


def op_db() -> list[Any]:
    """PyTorch's OpInfo database (imports ``expecttest``, a test-only dependency: ``pip install -e '.[dev]'``)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db as database
    except ImportError as error:  # expecttest missing
        raise SurveyError(f"cannot import PyTorch's OpInfo database ({error}); install the dev extra: "
                          "pip install -e '.[dev]'") from error
    return list(database)


def normalize_stack(text: str) -> str:
    """``vmap(grad)`` or ``vmap,grad`` to the survey's spelling; raises SurveyError naming the valid stacks."""
    try:
        stack = canonical_workload(text)  # the one spelling, aliases kept as written (jacrev is a survey stack)
    except ValueError:
        stack = text
    if stack not in SURVEY_STACKS:
        raise SurveyError(f"unknown survey stack {text!r}; valid: {', '.join(SURVEY_STACKS)}")
    return stack


def select_entries(database: Sequence[Any], names: Iterable[str] | None) -> list[Any]:
    """The entries named ``name`` (all variants) or ``name.variant``; all of them when ``names`` is None."""
    if not names:
        return list(database)
    by_id = {entry_id(o): o for o in database}
    chosen: dict[str, Any] = {}
    for name in names:
        matches = [o for o in database if entry_id(o) == name or o.name == name]
        if not matches:
            close = difflib.get_close_matches(name, list(by_id), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SurveyError(f"unknown op_db entry {name!r}{hint} (names are OpInfo names such as 'add' or "
                              "'scatter_reduce.prod')")
        chosen.update({entry_id(o): o for o in matches})
    return list(chosen.values())


# --- one case ---------------------------------------------------------------------------------------------------

_OWNERS: tuple[Any, ...] = (torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, torch.Tensor)


def live_callable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, looked up again at each call through the public attribute it was found under.

    OpInfo holds the function object it was built with; a ``use()`` that replaces ``torch.index_fill`` must be seen
    by the survey as a user sees it. Lambdas and methods reached through ``Tensor`` attributes need nothing.
    """
    name = getattr(fn, "__name__", None)
    if not name:
        return fn
    for owner in _OWNERS:
        if getattr(owner, name, None) is fn:
            return lambda *args, **kwargs: getattr(owner, name)(*args, **kwargs)
    return fn


def _vary(tensor: torch.Tensor, b: int, generator: torch.Generator) -> torch.Tensor:
    """Sample ``b`` of a batched argument: ``b == 0`` is OpInfo's own value. The others keep what OpInfo's value
    guarantees as far as possible: floats are scaled by 1 - 0.05 b (signs, zeros, order, positive definiteness and
    domains such as (0, 1) are kept), integers and booleans (indices, masks) permuted."""
    if b == 0:
        return tensor.detach().clone()
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.detach() * (1 - _VARIATION * b)
    flat = tensor.detach().reshape(-1)
    return flat[torch.randperm(flat.numel(), generator=generator)].reshape(tensor.shape).clone()


# Integer keyword arguments whose validity is their order: embedding_bag's offsets must not decrease. Their per-sample
# permutation is sorted again (the same values as OpInfo's: nothing varies, and the other leaves' draws stay put).
ORDERED_ARGUMENTS = frozenset({"offsets"})


def _ordered_leaves(sample: Any) -> frozenset[int]:
    """Positions, among the flattened leaves of (input, args, kwargs), of the tensors passed as ORDERED_ARGUMENTS."""
    leaves, _ = tree_flatten_with_path((sample.input, sample.args, sample.kwargs))
    return frozenset(i for i, (path, leaf) in enumerate(leaves)
                     if isinstance(leaf, torch.Tensor) and not leaf.dtype.is_floating_point and len(path) == 2
                     and getattr(path[0], "idx", None) == 2 and getattr(path[1], "key", None) in ORDERED_ARGUMENTS)


def _clone_leaf(value: Any) -> Any:
    # Ops such as batch_norm update a non-batched argument (running statistics) in place: every call gets copies.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class SurveyCase:
    """One SampleInput and one batching variant: the leaves a stack batches (``batched``), those it differentiates
    (``diff``, a subset of ``batched``) and the per-sample values of the batched leaves."""

    def __init__(self, opinfo: Any, sample: Any, batching: str, batch: int, seed: int = SEED, *,
                 leaves: Sequence[int] | None = None, last_dim: bool = False) -> None:
        """``leaves``: the positions (among the tensor leaves of input, args and kwargs, flattened) to batch instead
        of ``batching``'s; ``last_dim``: vmap finds their batch dimension last rather than first (``in_dims=-1``)."""
        self.opinfo = opinfo
        self.call_op = live_callable(opinfo.op)
        self.leaves, self.spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        self.output_process = sample.output_process_fn_grad
        input_count = len(tree_flatten(sample.input)[0])
        tensors = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
        chosen = ([i for i in tensors if (i < input_count) == (batching == "input")] if leaves is None
                  else [i for i in tensors if i in leaves])
        self.batched: tuple[int, ...] = tuple(chosen)
        self.in_dims: tuple[int, ...] = tuple(-1 if last_dim else 0 for _ in chosen)
        self.diff: tuple[int, ...] = tuple(i for i in chosen if self.leaves[i].dtype.is_floating_point)
        self.layouts = {self.leaves[i].layout for i in tensors}
        generator = torch.Generator().manual_seed(seed)
        strided = self.layouts == {torch.strided}
        ordered = _ordered_leaves(sample)
        self.per_sample: list[tuple[torch.Tensor, ...]] = [
            tuple((_vary(self.leaves[i], b, generator).sort().values if i in ordered else
                   _vary(self.leaves[i], b, generator)) if strided else self.leaves[i] for i in self.batched)
            for b in range(batch)
        ]
        self.tangents: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.randn(self.leaves[i].shape, generator=generator, dtype=torch.float64)
                  .to(self.leaves[i].dtype) for i in self.diff)
            for _ in range(batch)
        ]
        self.random = False  # set by survey_entry when two seeds give two outputs
        self.dynamic = False  # set by survey_entry when the output's shape depends on the values
        self._weights: tuple[torch.Tensor, ...] | None = None
        self._directions: tuple[tuple[torch.Tensor, ...], ...] | None = None

    # The op, called with some leaves replaced: ``values`` holds the batched leaves in order, ``diff_values`` (if
    # given) the differentiated ones, overriding.
    def call(self, values: Sequence[Any], diff_values: Sequence[Any] | None = None) -> Any:
        leaves = [_clone_leaf(v) for v in self.leaves]
        for i, value in zip(self.batched, values, strict=True):
            leaves[i] = value
        if diff_values is not None:
            for i, value in zip(self.diff, diff_values, strict=True):
                leaves[i] = value
        sample_input, args, kwargs = tree_unflatten(leaves, self.spec)
        if self.random:
            torch.manual_seed(SEED)
        # OpInfo's own wrapper for gradient checks: symmetrizes the input of ops that read one triangle (cholesky,
        # eigh), so that forward and reverse mode describe the same function; the identity for most ops.
        return self.opinfo.gradcheck_wrapper(self.call_op, sample_input, *args, **kwargs)

    def differentiable_outputs(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The floating outputs that gradients flow from (after OpInfo's ``output_process_fn_grad``)."""
        leaves, _ = tree_flatten(self.output_process(output))
        return tuple(t for t in leaves if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)

    def weights(self) -> tuple[torch.Tensor, ...]:
        """Fixed random weights of the scalar loss sum(w * y) that the gradient stacks differentiate."""
        if self._weights is None:
            outputs = self.differentiable_outputs(self.call(self.per_sample[0]))
            generator = torch.Generator().manual_seed(SEED + 1)
            self._weights = tuple(torch.randn(y.shape, generator=generator, dtype=torch.float64).to(y.dtype)
                                  for y in outputs)
        return self._weights

    def loss(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum((w * y).sum() for w, y in zip(self.weights(), outputs, strict=True))  # type: ignore[return-value]

    def directions(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Random output cotangents ``u``: a Jacobian ``J`` is checked as ``u^T J`` against one backward pass each.

        A wrong entry of ``J`` changes ``u^T J`` for almost every ``u``, and the reference costs two backward passes
        instead of one per output element.
        """
        if self._directions is None:
            outputs = self.differentiable_outputs(self.call(self.per_sample[0]))
            generator = torch.Generator().manual_seed(SEED + 2)
            self._directions = tuple(
                tuple(torch.randn(y.shape, generator=generator, dtype=torch.float64).to(y.dtype) for y in outputs)
                for _ in range(JACOBIAN_DIRECTIONS))
        return self._directions

    def diff_slots(self) -> tuple[int, ...]:
        """Positions of the differentiated leaves among the batched ones."""
        return tuple(self.batched.index(i) for i in self.diff)


def _stacked(per_sample: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack([values[k] for values in per_sample]) for k in range(len(per_sample[0])))


# --- the interpreter: a stack applied with torch.func, and its reference outside any transform ------------------


def run_stack(stack: str, case: SurveyCase) -> Any:
    """``case``'s op under ``stack`` through torch.func: what the reference must equal."""
    slots = case.diff_slots()

    def outputs_at(values: Sequence[Any], diff_values: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        return case.differentiable_outputs(case.call(values, diff_values))

    if stack == "vmap":
        # The batch dimension where in_dims says: stacked first, moved last for in_dims=-1.
        stacked = tuple(t.movedim(0, d) for t, d in zip(_stacked(case.per_sample), case.in_dims, strict=True))
        return tree_flatten(func.vmap(lambda *v: case.call(v), in_dims=case.in_dims)(*stacked))[0]
    if stack == "jvp":
        base = case.per_sample[0]
        return func.jvp(lambda *d: outputs_at(base, d), tuple(base[s] for s in slots), tuple(case.tangents[0]))
    if stack == "grad(vmap)":
        stacked = _stacked(case.per_sample)

        def batch_loss(*d: torch.Tensor) -> torch.Tensor:
            values = list(stacked)
            for s, value in zip(slots, d, strict=True):
                values[s] = value
            # The per-sample weights broadcast over the batch: the loss is the sum of the per-sample losses.
            return case.loss(func.vmap(lambda *v: case.differentiable_outputs(case.call(v)))(*values))

        return func.grad(batch_loss, tuple(range(len(slots))))(*(stacked[s] for s in slots))
    if stack == "jvp(grad)":
        base = case.per_sample[0]
        loss = lambda *d: case.loss(outputs_at(base, d))  # noqa: E731
        gradient = func.grad(loss, tuple(range(len(slots))))
        return func.jvp(gradient, tuple(base[s] for s in slots), tuple(case.tangents[0]))
    if stack == "grad":
        base = case.per_sample[0]
        loss = lambda *d: case.loss(outputs_at(base, d))  # noqa: E731
        return func.grad(loss, tuple(range(len(slots))))(*(base[s] for s in slots))
    if stack == "vmap(grad)":
        def per_sample_grad(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            loss = lambda *d: case.loss(outputs_at(values, d))  # noqa: E731
            return func.grad(loss, tuple(range(len(slots))))(*(values[s] for s in slots))

        return func.vmap(per_sample_grad)(*_stacked(case.per_sample))
    if stack in ("jacrev", "jacfwd"):
        base = case.per_sample[0]
        transform = func.jacrev if stack == "jacrev" else func.jacfwd
        return transform(lambda *d: outputs_at(base, d), tuple(range(len(slots))))(*(base[s] for s in slots))
    if stack == "vmap(jvp)":
        count = len(case.batched)

        def per_sample_jvp(*values_and_tangents: torch.Tensor) -> Any:
            values, tangents = values_and_tangents[:count], values_and_tangents[count:]
            return func.jvp(lambda *d: outputs_at(values, d), tuple(values[s] for s in slots), tuple(tangents))

        return func.vmap(per_sample_jvp)(*_stacked(case.per_sample), *_stacked(case.tangents))
    raise SurveyError(f"unknown survey stack {stack!r}; valid: {', '.join(INTERPRETER_STACKS)}")


class Reference:
    """Native PyTorch outside any transform, per sample; computed once per case, shared by all stacks and modes."""

    def __init__(self, case: SurveyCase) -> None:
        self.case = case
        self._outputs: list[list[Any]] | None = None
        self._grads: dict[int, tuple[torch.Tensor, ...]] = {}

    def outputs(self) -> list[list[Any]]:
        if self._outputs is None:
            self._outputs = [tree_flatten(self.case.call(v))[0] for v in self.case.per_sample]
        return self._outputs

    def _leaves(self, b: int) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        values = list(self.case.per_sample[b])
        leaves = tuple(values[s].detach().clone().requires_grad_() for s in self.case.diff_slots())
        return values, leaves

    def grads(self, b: int) -> tuple[torch.Tensor, ...]:
        if b not in self._grads:
            values, leaves = self._leaves(b)
            outputs = self.case.differentiable_outputs(self.case.call(values, leaves))
            self._grads[b] = torch.autograd.grad(self.case.loss(outputs), leaves, allow_unused=True,
                                                 materialize_grads=True)
        return self._grads[b]

    def vjp(self, b: int, cotangents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``u^T J`` per differentiated leaf, for output cotangents ``u``: one backward pass."""
        values, leaves = self._leaves(b)
        outputs = self.case.differentiable_outputs(self.case.call(values, leaves))
        return torch.autograd.grad(outputs, leaves, tuple(cotangents), allow_unused=True, materialize_grads=True)

    def hvp(self, b: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(the loss's gradient, its derivative along sample ``b``'s tangents): a double backward."""
        values, leaves = self._leaves(b)
        outputs = self.case.differentiable_outputs(self.case.call(values, leaves))
        grads = torch.autograd.grad(self.case.loss(outputs), leaves, create_graph=True, allow_unused=True,
                                    materialize_grads=True)
        used = [(g, leaf, t) for g, leaf, t in zip(grads, leaves, self.case.tangents[b], strict=True)
                if g.requires_grad]
        if used:
            # The Hessian is symmetric: the vjp of the gradient with the tangents is its jvp.
            products = torch.autograd.grad([g for g, _, _ in used], leaves, [t for _, _, t in used],
                                           allow_unused=True, materialize_grads=True)
        else:  # the gradient does not depend on the inputs: the Hessian is zero
            products = tuple(torch.zeros_like(leaf) for leaf in leaves)
        return tuple(g.detach() for g in grads), tuple(products)

    def jvp(self, b: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(outputs, ``J t``) for sample ``b``'s tangents ``t``.

        ``J t`` is a double vjp where the op has a double backward (``u -> J^T u`` is linear, its vjp with ``t`` is
        ``J t``), independent of the op's forward-mode formula; else ``torch.autograd.forward_ad``.
        """
        tangents = self.case.tangents[b]
        values, leaves = self._leaves(b)
        if self.case.opinfo.supports_gradgrad:
            outputs = self.case.differentiable_outputs(self.case.call(values, leaves))
            cotangents = tuple(torch.zeros_like(y, requires_grad=True) for y in outputs)
            vjps = torch.autograd.grad(outputs, leaves, cotangents, create_graph=True, allow_unused=True,
                                       materialize_grads=True)
            used = [(g, t) for g, t in zip(vjps, tangents, strict=True) if g.requires_grad]
            if used:
                tangent_outputs = torch.autograd.grad([g for g, _ in used], cotangents, [t for _, t in used],
                                                      allow_unused=True, materialize_grads=True)
            else:  # the vjp does not depend on u: J is zero
                tangent_outputs = tuple(torch.zeros_like(y) for y in outputs)
            return tuple(y.detach() for y in outputs), tuple(tangent_outputs)
        import torch.autograd.forward_ad as fwad

        with fwad.dual_level():
            duals = tuple(fwad.make_dual(leaf.detach(), t) for leaf, t in zip(leaves, tangents, strict=True))
            outputs = self.case.differentiable_outputs(self.case.call(values, duals))
            unpacked = [fwad.unpack_dual(y) for y in outputs]
            return (tuple(u.primal.clone() for u in unpacked),
                    tuple(u.tangent.clone() if u.tangent is not None else torch.zeros_like(u.primal)
                          for u in unpacked))


class _Unsupported(Exception):  # noqa: N818 -- an outcome, not a failure
    """The case cannot be checked (no reference, no differentiable argument, ...)."""


def reference(stack: str, ref: Reference) -> Any:
    """What ``run_stack(stack, case)`` must return, computed by native PyTorch outside any transform."""
    count = len(ref.case.per_sample)
    if stack == "vmap":
        outputs = ref.outputs()
        shapes = {tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in leaves) for leaves in outputs}
        if len(shapes) > 1:
            raise _Unsupported("dynamic shape op: the per-sample outputs differ in shape")
        return [torch.stack([leaves[k] for leaves in outputs]) if isinstance(outputs[0][k], torch.Tensor)
                else outputs[0][k] for k in range(len(outputs[0]))]
    if stack == "grad":
        return ref.grads(0)
    if stack == "jvp":
        return ref.jvp(0)
    if stack == "jvp(grad)":
        return ref.hvp(0)
    if stack in ("vmap(grad)", "grad(vmap)"):
        per = [ref.grads(b) for b in range(count)]
        return tuple(torch.stack([g[j] for g in per]) for j in range(len(per[0])))
    if stack in ("jacrev", "jacfwd"):
        return tuple(ref.vjp(0, u) for u in ref.case.directions())
    if stack == "vmap(jvp)":
        per = [ref.jvp(b) for b in range(count)]
        outputs = tuple(torch.stack([p[0][i] for p in per]) for i in range(len(per[0][0])))
        tangents = tuple(torch.stack([p[1][i] for p in per]) for i in range(len(per[0][1])))
        return outputs, tangents
    raise SurveyError(f"unknown survey stack {stack!r}; valid: {', '.join(INTERPRETER_STACKS)}")


def project_jacobian(jacobian: Any, case: SurveyCase) -> Any:
    """``u^T J`` per direction ``u`` and differentiated leaf, from a torch.func Jacobian (outputs x leaves); raises
    _Mismatch when its structure or shapes are not those of the op's outputs and leaves."""
    directions = case.directions()
    leaves = [case.per_sample[0][s] for s in case.diff_slots()]
    if not isinstance(jacobian, tuple) or len(jacobian) != len(directions[0]):
        raise _Mismatch(f"jacobian: {len(jacobian) if isinstance(jacobian, tuple) else type(jacobian).__name__} "
                        f"output blocks != {len(directions[0])}")
    for i, row in enumerate(jacobian):
        for j, block in enumerate(row):
            want = (*directions[0][i].shape, *leaves[j].shape)
            if tuple(block.shape) != want:
                raise _Mismatch(f"jacobian[{i}][{j}]: shape {tuple(block.shape)} != {want}")
    # jacfwd's Jacobian has the output's dtype, jacrev's the input's (torch.func's convention); the reference is a
    # vjp, in the input's dtype.
    return tuple(
        tuple(sum(torch.tensordot(u[i].to(row[j].dtype), row[j], dims=u[i].dim()) for i, row in enumerate(jacobian))
              .to(leaves[j].dtype) for j in range(len(leaves)))
        for u in directions)


class _Mismatch(Exception):  # noqa: N818 -- an outcome, not a failure
    pass


@dataclass(frozen=True)
class Tolerance:
    """Where a result is rounding rather than wrong: every element within ``atol + rtol * scale`` of the reference,
    ``scale`` the reference tensor's largest finite magnitude (a Jacobian projected on ``u`` sums terms of that size,
    so its small entries carry the rounding of the large ones)."""

    rtol: float
    atol: float


# Keyed by the dtype of the tensor compared (a float64 sample may hold a float32 tensor: cov's aweights). Measured
# over the float32 cases of the survey's mismatching entries against the same case cast to float64
# (docs/verification.md, Survey, tolerances): float32 rounding reached 0.0087 of the scale
# (multi_head_attention_forward, whose float32 reference is itself 0.0056 from float64's) and 2.4e-4 absolute where
# the reference is 0 (layer_norm); every wrong result was at least 1.4 of the scale. float64 keeps its earlier
# bounds, written norm-wise.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=3e-2, atol=1e-3),
    torch.float64: Tolerance(rtol=1e-5, atol=1e-6),
}
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def tolerance_for(tensor_dtype: torch.dtype, case_dtype: torch.dtype) -> Tolerance:
    """The tolerance of a tensor of ``tensor_dtype`` in a case of ``case_dtype`` (half precision: the case's)."""
    return TOLERANCES.get(_REAL.get(tensor_dtype, tensor_dtype)) or TOLERANCES[case_dtype]


def compare(actual: Any, expected: Any, dtype: torch.dtype, where: str = "output") -> Outcome | None:
    """None when equal within tolerance (TOLERANCES), else a mismatch naming where and by how much."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return Outcome("mismatch", f"{where}: expected a tensor, got {type(actual).__name__}")
        # A sparse gradient (embedding_bag(sparse=True)'s reference) is compared by value: torch.func's are dense.
        actual, expected = (t.to_dense() if t.layout != torch.strided else t for t in (actual, expected))
        if actual.shape != expected.shape:
            return Outcome("mismatch", f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        if actual.dtype != expected.dtype:
            return Outcome("mismatch", f"{where}: dtype {actual.dtype} != {expected.dtype}")
        a, e = actual.detach(), expected.detach()
        if not (e.dtype.is_floating_point or e.dtype.is_complex):
            return None if torch.equal(a, e) else Outcome("mismatch", f"{where}: values differ")
        # Where the reference is inf or nan it has no value to check against (a Jacobian projected on u turns an
        # inf into nan through 0 * inf; a double vjp overflows where the jvp does not): compare the rest.
        unchecked = ~e.isfinite()
        wide = torch.complex128 if e.dtype.is_complex else torch.float64
        a, e = a.masked_fill(unchecked, 0).to(wide), e.masked_fill(unchecked, 0).to(wide)
        diff = (a - e).abs().nan_to_num(nan=math.inf)
        scale = e.abs().max().item() if e.numel() else 0.0
        tolerance = tolerance_for(expected.dtype, dtype)
        if e.numel() and bool((diff > tolerance.atol + tolerance.rtol * scale).any()):
            rel = diff / e.abs().clamp_min(1e-12)
            max_abs, max_rel = diff.max().item(), rel.max().item()
            return Outcome("mismatch", f"{where}: max abs error {max_abs:.3g}, max rel error {max_rel:.3g}",
                           max_abs, max_rel)
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            return Outcome("mismatch", f"{where}: expected {len(expected)} results, got {type(actual).__name__}")
        if len(actual) != len(expected):
            return Outcome("mismatch", f"{where}: {len(actual)} results != {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if (outcome := compare(a, e, dtype, f"{where}[{i}]")) is not None:
                return outcome
        return None
    if actual != expected:
        return Outcome("mismatch", f"{where}: {actual!r} != {expected!r}")
    return None


def _unsupported_reason(error: BaseException) -> str | None:
    text = str(error)
    return next((reason for needle, reason in _UNSUPPORTED_MESSAGES if needle in text), None)


class _Timeout(Exception):  # noqa: N818 -- an outcome, not a failure
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _Timeout in the main thread after ``seconds`` (a kernel that never returns to Python is left to the
    worker's own deadline)."""
    if (seconds <= 0 or os.name != "posix" or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None)):
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise _Timeout(f"timed out after {seconds:g} s")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def repeated_unpool_indices(indices: torch.Tensor, spatial: int) -> bool:
    """Whether two entries of one channel of max_unpool's ``indices`` (the last ``spatial`` dimensions) are equal."""
    if indices.numel() == 0:
        return False
    planes = indices.reshape(-1, math.prod(indices.shape[-spatial:]) if indices.dim() >= spatial else 1)
    ordered = planes.sort(-1).values
    return bool((ordered[:, 1:] == ordered[:, :-1]).any())


_UNPOOL_SPATIAL = {"nn.functional.max_unpool1d": 1, "nn.functional.max_unpool2d": 2, "nn.functional.max_unpool3d": 3}
# Where max_unpool's indices repeat within a channel, which value lands there is unspecified (PyTorch's MaxUnpool
# documentation; measured: on two threads native's own result changes with the input's memory format, its
# channels_last kernel writing one channel from several threads):
# the stacks that compare values or tangents have nothing to compare. Gradients gather, and stay checked.
_UNSPECIFIED_STACKS = frozenset({"vmap", "jacfwd", "vmap(jvp)", "jvp"})


def _unspecified_reason(case: SurveyCase, stack: str) -> str | None:
    spatial = _UNPOOL_SPATIAL.get(case.opinfo.name)
    if spatial is None or stack not in _UNSPECIFIED_STACKS:
        return None
    integer = [i for i, leaf in enumerate(case.leaves) if isinstance(leaf, torch.Tensor) and not
               (leaf.dtype.is_floating_point or leaf.dtype.is_complex)]
    slots = [case.batched.index(i) for i in integer if i in case.batched]
    candidates = [case.leaves[i] for i in integer] + [values[s] for values in case.per_sample for s in slots]
    if any(repeated_unpool_indices(t, spatial) for t in candidates):
        return ("repeated indices within a channel: PyTorch leaves max_unpool's value there unspecified (native's own "
                "result depends on the input's memory format and the threads)")
    return None


def static_reason(case: SurveyCase, stack: str, dtype: torch.dtype) -> str | None:
    """Why ``stack`` cannot be checked on ``case`` at all, before running anything."""
    opinfo = case.opinfo
    if opinfo.name in UNINITIALIZED:
        return "the output is uninitialized memory: nothing to compare"
    if (reason := _unspecified_reason(case, stack)) is not None:
        return reason
    if case.layouts - {torch.strided}:
        return f"{', '.join(sorted(str(x) for x in case.layouts - {torch.strided}))} arguments: torch.func handles " \
               "strided tensors only"
    if not case.batched:
        return "no tensor among the arguments this batching variant batches"
    if stack in _REVERSE | _FORWARD and not case.diff:
        return "no floating tensor to differentiate among the batched arguments"
    if stack in _REVERSE and not opinfo.supports_autograd:
        return "op does not support autograd"
    if stack in _FORWARD and not opinfo.supports_forward_ad:
        return "op does not support forward-mode AD"
    if stack == "jvp(grad)" and not opinfo.supports_fwgrad_bwgrad:
        return "op does not support forward-over-reverse AD"
    if stack in _BATCHED and case.random:
        return "random op: vmap's per-sample results follow its randomness flag, not a loop"
    return None


def check_case(stack: str, case: SurveyCase, ref: Reference, dtype: torch.dtype, *, inside_use: bool,
               timeout_s: float, pins: Mapping[str, str] | None = None) -> Outcome:
    """Run ``stack`` on ``case`` (inside ``registry.use(pins=pins)`` when asked) and classify it against the
    reference."""
    if (reason := static_reason(case, stack, dtype)) is not None:
        return Outcome("unsupported", reason)
    try:
        base_output = case.call(case.per_sample[0])
    except Exception as error:  # native itself fails outside any transform on these arguments
        return Outcome("unsupported", f"reference (native, no transform) fails: {described(error)}")
    layouts = {t.layout for t in tree_flatten(base_output)[0] if isinstance(t, torch.Tensor)} - {torch.strided}
    if layouts:
        return Outcome("unsupported", f"{', '.join(sorted(map(str, layouts)))} output: torch.func handles strided "
                                      "tensors only")
    if stack in _REVERSE | _FORWARD and not case.differentiable_outputs(base_output):
        return Outcome("unsupported", "no floating output to differentiate")
    try:
        with _deadline(timeout_s):
            expected = reference(stack, ref)
    except _Unsupported as reason:
        return Outcome("unsupported", str(reason))
    except Exception as error:  # native itself fails outside any transform on these arguments
        return Outcome("unsupported", f"reference (native, no transform) fails: {described(error)}")
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with _deadline(timeout_s), (_use(pins) if inside_use else contextlib.nullcontext()):
                    actual = run_stack(stack, case)
            except _Timeout as error:
                return Outcome("error", str(error))
            except Exception as error:  # an op failing under a transform is data here, not a crash
                if (reason := _unsupported_reason(error)) is not None:
                    return Outcome("unsupported", f"{reason}: {described(error)}")
                return Outcome("error", described(error))
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    if stack in ("jacrev", "jacfwd"):
        try:
            actual = project_jacobian(actual, case)
        except _Mismatch as error:
            return Outcome("mismatch", str(error))
    if (mismatch := compare(actual, expected, dtype, "u^T J" if stack in ("jacrev", "jacfwd") else "output")) \
            is not None:
        return mismatch
    slow = [str(w.message) for w in caught if FALLBACK_WARNING in str(w.message)]
    if slow:
        return Outcome("slow", slow[0].strip().splitlines()[0][:300])
    return Outcome("ok")


def _use(pins: Mapping[str, str] | None = None) -> contextlib.AbstractContextManager[Any]:
    import registry

    return registry.use(pins=pins)


# --- one op_db entry ----------------------------------------------------------------------------------------------


def _sample_size(sample: Any) -> int:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))


ALL_SAMPLES = 0  # limit_samples: every sample OpInfo generates, whatever its size
_GENERATED_ALL = 512  # a bound in case a generator is endless


def pick_samples(opinfo: Any, dtype: torch.dtype, limit: int) -> list[Any]:
    """The first ``limit`` samples in OpInfo's order with at most SIZE_CAP elements in all (the smallest sample when
    none is that small); at most 64 samples are generated. ``limit`` ALL_SAMPLES (0): every sample, any size."""
    if limit == ALL_SAMPLES:
        every = []
        for sample in opinfo.sample_inputs("cpu", dtype, requires_grad=False):
            every.append(sample)
            if len(every) >= _GENERATED_ALL:
                break
        return every
    samples = []
    for index, sample in enumerate(opinfo.sample_inputs("cpu", dtype, requires_grad=False)):
        samples.append(sample)
        if index >= 63:
            break
    small = [s for s in samples if _sample_size(s) <= SIZE_CAP]
    if small:
        return small[:limit]
    return sorted(samples, key=_sample_size)[:1]


def sample_is_random(opinfo: Any, sample: Any) -> bool:
    """``_is_random``, False where the op fails on the sample (the cases report native's failure themselves)."""
    try:
        return _is_random(opinfo, sample)
    except Exception:
        return False


def prepare_case(opinfo: Any, sample: Any, batching: str, batch: int, random: bool) -> SurveyCase | Outcome:
    """The case of one OpInfo sample and batching variant, its ``random`` and ``dynamic`` flags set; or the
    "unsupported" outcome where OpInfo's sample cannot be varied per sample (nothing to check)."""
    try:
        case = SurveyCase(opinfo, sample, batching, batch)
    except Exception as error:
        return Outcome("unsupported", f"cannot build per-sample arguments: {described(error)}")
    case.random = random
    case.dynamic = is_dynamic(opinfo, sample, case.batched)
    return case


def _is_random(opinfo: Any, sample: Any) -> bool:
    """Two seeds, two outputs: the op draws random numbers."""
    outputs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        sample_input, args, kwargs = tree_unflatten([_clone_leaf(v) for v in leaves], spec)
        outputs.append(tree_flatten(opinfo.op(sample_input, *args, **kwargs))[0])
    return compare(outputs[0], outputs[1], torch.float64) is not None


def _output_shapes(opinfo: Any, sample: Any, fill: Callable[[torch.Tensor], torch.Tensor] | None,
                   filled: tuple[int, ...]) -> tuple[Any, ...]:
    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    leaves = [(fill(v) if fill is not None and i in filled and v.dtype in (torch.bool, *_FLOATS) else _clone_leaf(v))
              if isinstance(v, torch.Tensor) else v for i, v in enumerate(leaves)]
    sample_input, args, kwargs = tree_unflatten(leaves, spec)
    output = tree_flatten(opinfo.op(sample_input, *args, **kwargs))[0]
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in output)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_dynamic(opinfo: Any, sample: Any, filled: tuple[int, ...]) -> bool:
    """The output's shape depends on the values of the ``filled`` leaves (nonzero's input, masked_select's mask):
    all zeros and all ones there (floats and masks; indices kept) give different output shapes. Such an op cannot be
    batched over those arguments, only padded."""
    shapes = set()
    for fill in (None, torch.zeros_like, torch.ones_like):
        try:
            shapes.add(_output_shapes(opinfo, sample, fill, filled))
        except Exception:  # a domain error on all zeros says nothing about shapes
            continue
    return len(shapes) > 1


def dynamic_outcome(case: SurveyCase, stack: str, outcome: Outcome) -> Outcome:
    """A dynamic-shape op that vmap cannot batch is out of scope (it needs a padded form), not a coverage gap."""
    if case.dynamic and stack in _BATCHED and outcome.status in MISBEHAVING:
        return Outcome("unsupported", f"dynamic shape op, {outcome.status}: {outcome.detail}")
    return outcome


def worse_outcome(a: Outcome | None, b: Outcome) -> Outcome:
    """The worse of two outcomes (RANK); ``b`` when there is no ``a`` yet."""
    return b if a is None or RANK.index(b.status) > RANK.index(a.status) else a


def survey_entry(opinfo: Any, dtype_name: str, config: SurveyConfig) -> list[SurveyRow]:
    """Every (stack, batching) row of one op_db entry at one dtype."""
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")  # deprecation chatter of the ops themselves; vmap's warnings are caught inside
        # OpInfo draws its samples from the global generator: seeded, an entry's rows depend on nothing else.
        torch.manual_seed(SEED)
        return _survey_entry(opinfo, dtype_name, config)


def _survey_entry(opinfo: Any, dtype_name: str, config: SurveyConfig) -> list[SurveyRow]:
    dtype = getattr(torch, dtype_name)
    name = entry_id(opinfo)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def row(stack: str, batching: str, native: Outcome, used: Outcome, samples: int) -> SurveyRow:
        return SurveyRow(op=name, opinfo_name=opinfo.name, variant_test_name=opinfo.variant_test_name, stack=stack,
                         batching=batching, dtype=dtype_name, native_status=native.status,
                         native_detail=native.detail, use_status=used.status, use_detail=used.detail,
                         max_abs_error=native.max_abs_error, max_rel_error=native.max_rel_error, samples=samples,
                         torch_version=torch.__version__, timestamp=stamp)

    def every_row(outcome: Outcome) -> list[SurveyRow]:
        return [row(s, b, outcome, outcome, 0) for s in config.stacks for b in config.batchings]

    if dtype not in opinfo.supported_dtypes("cpu"):
        return every_row(Outcome("unsupported", f"op does not support {dtype_name} on CPU"))
    try:
        with _deadline(config.case_timeout_s):
            samples = pick_samples(opinfo, dtype, config.limit_samples)
    except Exception as error:  # OpInfo's own generator failing is reported, not raised
        return every_row(Outcome("unsupported", f"OpInfo's sample_inputs fails: {described(error)}"))
    if not samples:
        return every_row(Outcome("unsupported", "OpInfo has no sample input"))
    randomness = {index: sample_is_random(opinfo, sample) for index, sample in enumerate(samples)}
    rows = []
    for batching in config.batchings:
        worst: dict[str, tuple[Outcome | None, Outcome | None, int]] = {s: (None, None, 0) for s in config.stacks}
        for index, sample in enumerate(samples):
            case = prepare_case(opinfo, sample, batching, config.batch, randomness[index])
            if isinstance(case, Outcome):
                for stack in config.stacks:
                    native, used, count = worst[stack]
                    worst[stack] = (worse_outcome(native, case), worse_outcome(used, case), count)
                continue
            ref = Reference(case)
            for stack in config.stacks:
                native_outcome = dynamic_outcome(case, stack, check_case(stack, case, ref, dtype, inside_use=False,
                                                                  timeout_s=config.case_timeout_s))
                used_outcome = (dynamic_outcome(case, stack, check_case(stack, case, ref, dtype, inside_use=True,
                                                                 timeout_s=config.case_timeout_s))
                                if config.inside_use else Outcome("unsupported", "not run inside use()"))
                native, used, count = worst[stack]
                checked = native_outcome.status != "unsupported"
                worst[stack] = (worse_outcome(native, native_outcome), worse_outcome(used, used_outcome),
                                count + checked)
        for stack in config.stacks:
            native, used, count = worst[stack]
            rows.append(row(stack, batching, native or Outcome("unsupported"), used or Outcome("unsupported"), count))
    return rows


# --- many entries: in process, or in forked workers --------------------------------------------------------------


def _crash_rows(opinfo: Any, dtype_name: str, config: SurveyConfig, why: str) -> list[SurveyRow]:
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return [SurveyRow(op=entry_id(opinfo), opinfo_name=opinfo.name, variant_test_name=opinfo.variant_test_name,
                      stack=s, batching=b, dtype=dtype_name, native_status="error", native_detail=why,
                      use_status="error", use_detail=why, max_abs_error=None, max_rel_error=None, samples=0,
                      torch_version=torch.__version__, timestamp=stamp)
            for s in config.stacks for b in config.batchings]


@dataclass
class _Worker:
    process: Any
    connection: Any
    job: tuple[int, str] | None = None
    started: float = 0.0


@dataclass
class SurveyRun:
    rows: list[SurveyRow] = field(default_factory=list)
    seconds: float = 0.0
    entries: int = 0


def run_survey(entries: Sequence[Any], dtypes: Sequence[str], config: SurveyConfig, *, workers: int = 0,
               job_timeout_s: float = 600.0,
               on_rows: Callable[[list[SurveyRow], int, int], None] | None = None) -> SurveyRun:
    """Survey ``entries`` at ``dtypes``; ``workers`` > 0 forks that many processes (a crashed or hung job becomes
    error rows, the survey goes on). ``on_rows(rows, done, total)`` sees each finished (entry, dtype) job."""
    for dtype_name in dtypes:
        if dtype_name not in DTYPES:
            raise SurveyError(f"unknown survey dtype {dtype_name!r}; valid: {', '.join(DTYPES)}")
    jobs = [(index, dtype_name) for index in range(len(entries)) for dtype_name in dtypes]
    result = SurveyRun(entries=len(entries))
    start = time.perf_counter()

    def finished(rows: list[SurveyRow]) -> None:
        result.rows.extend(rows)
        if on_rows is not None:
            on_rows(rows, len({(r.op, r.dtype) for r in result.rows}), len(jobs))

    if workers <= 0:
        for index, dtype_name in jobs:
            finished(survey_entry(entries[index], dtype_name, config))
    else:
        run_forked(entries, jobs, config, workers, job_timeout_s, finished)
    result.seconds = time.perf_counter() - start
    # Workers finish in any order; rows come back in op_db's order, then dtype, batching and stack order.
    position = {entry_id(e): i for i, e in enumerate(entries)}
    result.rows.sort(key=lambda r: (position.get(r.op, len(position)), dtypes.index(r.dtype),
                                    config.batchings.index(r.batching), config.stacks.index(r.stack)))
    return result


def _worker_main(connection: Any, entries: Sequence[Any], config: Any, work: Callable[..., list[Any]],
                 crash: Callable[..., list[Any]]) -> None:
    torch.set_num_threads(1)
    while True:
        job = connection.recv()
        if job is None:
            return
        index, dtype_name = job
        try:
            rows = work(entries[index], dtype_name, config)
        except Exception as error:  # sent back as error rows
            rows = crash(entries[index], dtype_name, config,
                         f"survey worker: {described(error)} ({traceback.format_exc(limit=1).strip()[-200:]})")
        connection.send(rows)


def run_forked(entries: Sequence[Any], jobs: list[tuple[int, str]], config: Any, workers: int,
                job_timeout_s: float, finished: Callable[[list[Any]], None],
                work: Callable[..., list[Any]] = survey_entry, crash: Callable[..., list[Any]] = _crash_rows) -> None:
    """Run ``work(entry, dtype, config)`` for each (entry index, dtype) job in ``workers`` forked processes; a job
    that raises, crashes its worker or outlives ``job_timeout_s`` becomes ``crash(entry, dtype, config, why)``."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")
    pending = list(reversed(jobs))
    pool: list[_Worker] = []

    def spawn() -> _Worker:
        parent, child = context.Pipe()
        process = context.Process(target=_worker_main, args=(child, entries, config, work, crash), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    def assign(worker: _Worker) -> None:
        if pending:
            worker.job = pending.pop()
            worker.started = time.monotonic()
            worker.connection.send(worker.job)
        else:
            worker.job = None

    threads = torch.get_num_threads()
    # While forking (replacements too): a worker inherits one thread, not an OpenMP pool that does not survive fork.
    torch.set_num_threads(1)
    pool = [spawn() for _ in range(min(workers, len(jobs)))]
    for worker in pool:
        assign(worker)
    try:
        while any(w.job is not None for w in pool):
            busy = [w for w in pool if w.job is not None]
            ready = wait([w.connection for w in busy], timeout=5.0)
            now = time.monotonic()
            for worker in busy:
                job = worker.job
                assert job is not None
                if worker.connection in ready:
                    try:
                        rows = worker.connection.recv()
                    except (EOFError, OSError):
                        worker.process.join(1)
                        rows = crash(entries[job[0]], job[1], config,
                                     f"survey worker died (exit code {worker.process.exitcode})")
                        pool[pool.index(worker)] = worker = spawn()
                    finished(rows)
                    assign(worker)
                elif now - worker.started > job_timeout_s:
                    worker.process.kill()
                    worker.process.join(1)
                    finished(crash(entries[job[0]], job[1], config,
                                   f"survey worker killed: the job took over {job_timeout_s:g} s"))
                    pool[pool.index(worker)] = worker = spawn()
                    assign(worker)
    finally:
        for worker in pool:
            with contextlib.suppress(OSError, BrokenPipeError):
                worker.connection.send(None)
            worker.process.join(2)
            if worker.process.is_alive():
                worker.process.kill()
        torch.set_num_threads(threads)


# --- findings -----------------------------------------------------------------------------------------------------


def summarize(rows: Sequence[SurveyRow], worst: int = 40) -> dict[str, Any]:
    """What misbehaves natively: op_db entries by kind and by stack, and the entries with most misbehaving rows."""
    entries = sorted({r.op for r in rows})
    bad = [r for r in rows if r.native_status in MISBEHAVING]
    by_kind = {kind: sorted({r.op for r in bad if r.native_status == kind}) for kind in FAILING}
    stacks = list(dict.fromkeys(r.stack for r in rows))
    by_stack = {s: {kind: len({r.op for r in bad if r.stack == s and r.native_status == kind})
                    for kind in FAILING} for s in stacks}
    per_entry: dict[str, list[SurveyRow]] = {}
    for r in bad:
        per_entry.setdefault(r.op, []).append(r)
    ranked = sorted(per_entry.items(), key=lambda item: (-sum(RANK.index(r.native_status) for r in item[1]), item[0]))
    use_bad = {r.op for r in rows if r.use_status in MISBEHAVING}
    worse_inside = sorted({r.op for r in rows if RANK.index(r.use_status) > RANK.index(r.native_status)
                           and r.use_status in MISBEHAVING})
    return {
        "torch_version": torch.__version__,
        "entries": len(entries),
        "rows": len(rows),
        "misbehaving_natively": len(per_entry),
        "misbehaving_inside_use": len(use_bad),
        "fixed_inside_use": sorted(set(per_entry) - use_bad),
        "worse_inside_use": worse_inside,
        "by_kind": {kind: len(names) for kind, names in by_kind.items()},
        "by_stack": by_stack,
        "unsupported_only": sorted(set(entries) - {r.op for r in rows if r.native_status != "unsupported"}),
        "worst": [
            {"op": op, "rows": len(items),
             "kinds": sorted({r.native_status for r in items}, key=RANK.index),
             "stacks": list(dict.fromkeys(r.stack for r in items)),
             "example": f"{items[0].stack} {items[0].batching} {items[0].dtype}: {items[0].native_status} "
                        f"{items[0].native_detail}"}
            for op, items in ranked[:worst]
        ],
    }


_SHORT = {"ok": "ok", "slow": "slow", "error": "ERR", "mismatch": "MISM", "unsupported": "-"}


def format_rows(rows: Sequence[SurveyRow], stacks: Sequence[str]) -> list[str]:
    """One line per op_db entry: per stack, native's worst status / the worst inside use() over batching and dtype
    (``-`` is unsupported); then one indented line per (stack) that misbehaves, with the worst detail."""
    by_entry: dict[str, list[SurveyRow]] = {}
    for r in rows:
        by_entry.setdefault(r.op, []).append(r)
    width = min(max([len(op) for op in by_entry] + [10]), 36)  # longer names push their row right
    lines = [f"{'op_db entry':{width}s}  " + " ".join(f"{s:>11s}" for s in stacks) + "   (native/use())"]
    for op, items in by_entry.items():
        cells, notes = [], []
        for stack in stacks:
            here = [r for r in items if r.stack == stack]
            if not here:
                cells.append(f"{'':>11s}")
                continue
            native = max(here, key=lambda r: RANK.index(r.native_status))
            used = max(here, key=lambda r: RANK.index(r.use_status))
            cells.append(f"{_SHORT[native.native_status] + '/' + _SHORT[used.use_status]:>11s}")
            if native.native_status in MISBEHAVING or used.use_status in MISBEHAVING:
                worst = native if native.native_status in MISBEHAVING else used
                detail = worst.native_detail if worst is native else worst.use_detail
                notes.append(f"    {stack} {worst.batching} {worst.dtype}: native {native.native_status}, "
                             f"use() {used.use_status}: {detail[:160]}")
        lines.append(f"{op:{width}s}  " + " ".join(cells))
        lines.extend(notes)
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    """The findings in a few lines: counts by kind and stack, and the worst entries."""
    kinds = ", ".join(f"{count} {kind}" for kind, count in summary["by_kind"].items())
    lines = [
        f"{summary['misbehaving_natively']} of {summary['entries']} op_db entries misbehave natively under at least "
        f"one stack (entries with at least one row of that kind: {kinds}); inside use(): "
        f"{summary['misbehaving_inside_use']} ({len(summary['fixed_inside_use'])} fixed, "
        f"{len(summary['worse_inside_use'])} worse)",
        "by stack (entries slow / mismatch / error): " + "; ".join(
            f"{stack} {c['slow']}/{c['mismatch']}/{c['error']}" for stack, c in summary["by_stack"].items()),
    ]
    if summary["worse_inside_use"]:
        lines.append("worse inside use(): " + ", ".join(summary["worse_inside_use"]))
    return "\n".join(lines)
