"""The interpreter of OpInfo cases: a case's op under a stack through torch.func (``run_stack``), what it must
equal computed by native PyTorch outside any transform, per sample (``Reference``, ``reference``), and one check
classified against it (``check_case``).

The reference never runs under a transform: values are a Python loop over the per-sample arguments, gradients
``torch.autograd.grad`` per sample, a Jacobian ``J`` is checked as ``u^T J`` against one backward pass per random
cotangent ``u``, and a jvp is a double vjp (so a wrong forward-mode formula shows as a mismatch). The interpreter
sees a case only through ``OpInfoCase``'s small interface: the tensors a stack batches or differentiates, how to
call the op on them, and the per-sample arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten  # noqa: PLC2701 - PyTorch's pytree

from registry.core.dynamic import REFUSAL_PHRASE
from registry.core.functionalization import remembering_apart
from registry.core.messages import described
from registry.harness import comparison, fallback
from registry.harness.deadline import CaseTimeout, deadline
from registry.harness.interpreter import Layout, program, transformed, weighted_square
from registry.harness.interpreter import reference as interpreted_reference  # this module's reference is per case
from registry.harness.opinfo_cases import (
    BATCHED_STACKS,
    DEPTH3_STACKS,
    FORWARD_STACKS,
    REVERSE_STACKS,
    SurveyCase,
    SurveyError,
    stack_samples,
    static_reason,
)
from registry.harness.outcomes import MISBEHAVING, Outcome

SURVEY_STACKS: tuple[str, ...] = ("vmap", "grad", "vmap(grad)", "jacrev", "jacfwd", "vmap(jvp)")
# The interpreter runs these too (the conformance suite's checks): jvp alone, the vjp of a vmapped function and
# forward-over-reverse (the jvp of grad, a Hessian-vector product).
MORE_STACKS: tuple[str, ...] = ("jvp", "grad(vmap)", "jvp(grad)")
# Stacks of depth 3 with an inner gradient (opinfo_cases.DEPTH3_STACKS): the survey runs them where asked
# (``--stack``), the conformance suite as its depth-3 checks.
INTERPRETER_STACKS: tuple[str, ...] = SURVEY_STACKS + MORE_STACKS + DEPTH3_STACKS

# vmap's own words for what it cannot do by design rather than by a missing rule: not a coverage gap.
RANDOM_UNDER_VMAP = "random operation while in randomness error mode"  # vmap's refusal of a random op
_UNSUPPORTED_MESSAGES: tuple[tuple[str, str], ...] = (
    ("batching operators that can output dynamic shape", "dynamic shape op"),
    ("batching operators that can support dynamic shape", "dynamic shape op (boolean mask indexing)"),
    (RANDOM_UNDER_VMAP, "random op (vmap randomness='error')"),
    (REFUSAL_PHRASE, "dynamic shape op (refused inside use(), naming the fixed-shape alternative)"),
)


# --- the interpreter: a stack applied with torch.func, and its reference outside any transform ------------------


def run_stack(stack: str, case: SurveyCase) -> Any:
    """``case``'s op under ``stack`` through the harness's interpreter (``registry.harness.interpreter``): what the
    reference must equal.

    The function the layers see takes the batched leaves (then, for a stack with jvp, the tangents of the
    differentiated ones) and gives the op's differentiable outputs; ``vmap`` alone sees every output. Stacks with
    vmap run on the samples stacked along dim 0 (the tangents too), the others on the first sample.
    """
    if stack not in INTERPRETER_STACKS:
        raise SurveyError(f"unknown survey stack {stack!r}; valid: {', '.join(INTERPRETER_STACKS)}")
    layers = program(stack)
    if layers == ("vmap",):
        # The batch dimension where in_dims says: stacked first, moved last for in_dims=-1.
        stacked = tuple(t.movedim(0, d) for t, d in zip(stack_samples(case.per_sample), case.in_dims, strict=True))
        return tree_flatten(transformed(layers, lambda *v: case.call(v), Layout((case.in_dims,)))(*stacked))[0]

    def outputs(*values: Any) -> tuple[torch.Tensor, ...]:
        return case.differentiable_outputs(case.call(values))

    if stack in DEPTH3_STACKS:
        args = stack_samples(case.per_sample)
        return transformed(layers, outputs, _depth3_layout(case, len(args)))(*args)
    tangents = "jvp" in layers
    if "vmap" in layers:
        args = (*stack_samples(case.per_sample), *(stack_samples(case.tangents) if tangents else ()))
    else:
        args = (*case.per_sample[0], *(case.tangents[0] if tangents else ()))
    layout = Layout(in_dims=((0,) * len(args),) * layers.count("vmap"), wrt=case.diff_slots(), loss=case.loss,
                    tangent=None, with_primal=True)
    return transformed(layers, outputs, layout)(*args)


def _square_loss(outputs: Any) -> torch.Tensor:
    """``sum(w * y * y)`` over a tensor or a tuple of them: the loss of the op's outputs and of the gradients a grad
    inside returns, so that every layer differentiates something nonlinear in what it sees."""
    return sum(weighted_square(y) for y in ((outputs,) if isinstance(outputs, torch.Tensor) else outputs))


def _depth3_layout(case: SurveyCase, count: int) -> Layout:
    """One vmap over dim 0 of every stacked argument; each differentiating layer with respect to the case's
    differentiated leaves."""
    return Layout(in_dims=((0,) * count,), wrt=case.diff_slots(), loss=_square_loss)


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

    def outputs_of(self, *values: Any) -> tuple[torch.Tensor, ...]:
        """The op's differentiable outputs on per-sample ``values``."""
        return self.case.differentiable_outputs(self.case.call(values))

    def grads(self, b: int) -> tuple[torch.Tensor, ...]:
        """The loss's gradient on sample ``b``: the interpreter's grad reference (``torch.autograd.grad``)."""
        if b not in self._grads:
            layout = Layout(wrt=self.case.diff_slots(), loss=self.case.loss)
            self._grads[b] = interpreted_reference(("grad",), self.outputs_of, layout)(*self.case.per_sample[b])
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
        """(outputs, ``J t``) for sample ``b``'s tangents ``t``: the interpreter's jvp reference.

        ``J t`` is a double vjp where the op has a double backward (``u -> J^T u`` is linear, its vjp with ``t`` is
        ``J t``), independent of the op's forward-mode formula; else ``torch.autograd.forward_ad``.
        """
        layout = Layout(wrt=self.case.diff_slots(), tangent=None, with_primal=True,
                        forward_ad=not self.case.opinfo.supports_gradgrad)
        jvp = interpreted_reference(("jvp",), self.outputs_of, layout)
        return jvp(*self.case.per_sample[b], *self.case.tangents[b])


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
    if stack in DEPTH3_STACKS:
        # The interpreter's reference: a loop over the samples, autograd.grad with create_graph where a layer outside
        # differentiates again, the Jacobian row by row.
        args = stack_samples(ref.case.per_sample)
        return interpreted_reference(program(stack), ref.outputs_of, _depth3_layout(ref.case, len(args)))(*args)
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


def tolerance_row(stack: str) -> str:
    """The row of ``comparison.TOLERANCES`` a case under ``stack`` is judged by: values under vmap alone per entry,
    whatever a stack differentiates relative to the largest value."""
    return "batched values" if stack == "vmap" else "derivatives"


def compare(actual: Any, expected: Any, dtype: torch.dtype, where: str = "output",
            tolerance: str = "derivatives") -> Outcome | None:
    """None when equal within the ``tolerance`` row (the compared tensor's dtype's entry, the case's ``dtype``'s for
    the dtypes it does not name), else a mismatch naming where and by how much (``registry.harness.comparison``)."""
    found = comparison.compare(actual, expected, tolerance=tolerance, dtype=dtype, where=where)
    return None if found is None else Outcome("mismatch", found.detail, found.max_abs_error, found.max_rel_error)


def _unsupported_reason(error: BaseException) -> str | None:
    text = str(error)
    return next((reason for needle, reason in _UNSUPPORTED_MESSAGES if needle in text), None)


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
    if stack in REVERSE_STACKS | FORWARD_STACKS and not case.differentiable_outputs(base_output):
        return Outcome("unsupported", "no floating output to differentiate")
    try:
        with deadline(timeout_s):
            expected = reference(stack, ref)
    except _Unsupported as reason:
        return Outcome("unsupported", str(reason))
    except Exception as error:  # native itself fails outside any transform on these arguments
        return Outcome("unsupported", f"reference (native, no transform) fails: {described(error)}")
    with fallback.watch() as caught:
        try:
            with deadline(timeout_s), (_use(pins) if inside_use else contextlib.nullcontext()) as run:
                actual = run_stack(stack, case)
        except CaseTimeout as error:
            return Outcome("error", str(error))
        except Exception as error:  # an op failing under a transform is data here, not a crash
            if (reason := _unsupported_reason(error)) is not None:
                return Outcome("unsupported", f"{reason}: {described(error)}")
            return Outcome("error", described(error))
    if stack in ("jacrev", "jacfwd"):
        try:
            actual = project_jacobian(actual, case)
        except _Mismatch as error:
            return Outcome("mismatch", str(error))
    if (mismatch := compare(actual, expected, dtype, "u^T J" if stack in ("jacrev", "jacfwd") else "output",
                            tolerance_row(stack))) is not None:
        return mismatch
    if (note := fallback.fallback_note(caught)) is not None:
        chosen = [] if run is None else [d.reason for d in run.decisions if d.native_loops]
        if chosen:
            # NOTE: vmap's loop over PyTorch's kernel where the selector measured it faster at these sizes
            # (registry.core.cost), or where no composite is valid, is use() working as meant, not a gap.
            return Outcome("ok", f"vmap's loop over PyTorch's kernel, chosen: {chosen[0]}")
        return Outcome("slow", note)
    return Outcome("ok")


@contextlib.contextmanager
def _use(pins: Mapping[str, str] | None = None) -> Iterator[Any]:
    """Inside ``registry.use(pins=pins, record=True)``, each case a program of its own: what one case remembered as
    needing functionalization must not functionalize the next (``functionalization.remembering_apart``). Yields the
    block's run (what it decided)."""
    import registry

    with remembering_apart(), registry.use(pins=pins, record=True) as block:
        yield block.run


def dynamic_outcome(case: SurveyCase, stack: str, outcome: Outcome) -> Outcome:
    """A dynamic-shape op that vmap cannot batch is out of scope (it needs a padded form), not a coverage gap."""
    if case.dynamic and stack in BATCHED_STACKS and outcome.status in MISBEHAVING:
        return Outcome("unsupported", f"dynamic shape op, {outcome.status}: {outcome.detail}")
    return outcome

