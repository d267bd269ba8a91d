"""OpInfo cases: PyTorch's op_db entries and samples made into cases a stack can run on.

One case is one OpInfo ``SampleInput`` (input, args, kwargs) and one batching variant (``input``: batch the tensors
of ``sample.input``; ``others``: batch the tensors among the other arguments; or chosen leaves): the per-sample
values of the batched leaves, the leaves that are differentiated, the loss weights, tangents and cotangents, and the
flags (random, dynamic shape) and static reasons that make a stack uncheckable on it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten  # noqa: PLC2701 - PyTorch's pytree

from registry.core.messages import described
from registry.harness import comparison
from registry.harness.outcomes import Outcome

BATCHINGS: tuple[str, ...] = ("input", "others")
DTYPES: tuple[str, ...] = ("float32", "float64")
DEFAULT_BATCH = 3  # samples per batch
SIZE_CAP = 512  # total elements of a sample's tensors: larger samples are used only when an entry has no smaller one
JACOBIAN_DIRECTIONS = 2  # random cotangents a Jacobian is projected on (see SurveyCase.directions)
SEED = 1234
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})
_VARIATION = 0.05  # per-sample float arguments: sample b is OpInfo's value scaled by 1 - b * this

# Stacks that differentiate, and which kind of derivative the op must support for them.
# Depth 3 with an inner gradient: meta-learning's grad over a vmap of inner gradient steps, per-sample second
# derivatives, the Jacobian of vmapped gradients. Each differentiates the op twice.
DEPTH3_STACKS = ("grad(vmap(grad))", "vmap(grad(grad))", "jacrev(vmap(grad))")
REVERSE_STACKS = frozenset({"grad", "vmap(grad)", "jacrev", "grad(vmap)", "jvp(grad)", *DEPTH3_STACKS})
FORWARD_STACKS = frozenset({"jacfwd", "vmap(jvp)", "jvp", "jvp(grad)"})
BATCHED_STACKS = frozenset({"vmap", "vmap(grad)", "vmap(jvp)", "grad(vmap)", *DEPTH3_STACKS})


class SurveyError(ValueError):
    """Bad survey input: an unknown op, stack, batching variant or dtype."""


def entry_id(opinfo: Any) -> str:
    """``name`` or ``name.variant``: how the survey and its CLI name an op_db entry."""
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


def op_db() -> list[Any]:
    """PyTorch's OpInfo database (imports ``expecttest``, a test-only dependency: ``pip install -e '.[dev]'``)."""
    try:
        from torch.testing._internal.common_methods_invocations import (  # noqa: PLC2701 - the OpInfo database
            op_db as database,
        )
    except ImportError as error:  # expecttest missing
        raise SurveyError(f"cannot import PyTorch's OpInfo database ({error}); install the dev extra: "
                          "pip install -e '.[dev]'") from error
    return list(database)


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


def stack_samples(per_sample: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack([values[k] for values in per_sample]) for k in range(len(per_sample[0])))


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


# PyTorch 2.13's backward of as_strided_scatter for self is inverted (measured: as_strided_scatter(x, src, (2,), (1,),
# 0) of a 4-element x gives x the gradient [1, 1, 0, 0], where src was written; its jvp gives [0, 0, 1, 1]): a loop of
# native autograd has the wrong gradient for self, and so have the references of forward stacks (a double vjp, or
# Jacobian rows by autograd.grad), so no differentiating stack of self has anything right to compare with.
# tests/composites/test_view_scatter.py checks them against autograd of the in-place form instead.
_WRONG_NATIVE_SELF_GRADIENT = frozenset({"as_strided_scatter"})


# PyTorch 2.13's backward of native_layer_norm with a bias and no weight returns a bias gradient that autograd cannot
# differentiate again: every eager double backward gives zeros with respect to the bias, so the references of the
# stacks that differentiate twice (a loop of autograd.grad with create_graph) are wrong wherever the bias is
# differentiated. tests/composites/test_silent_native_bugs.py checks those stacks against the same layer with a
# weight of ones instead.
_LAYER_NORMS = frozenset({"native_layer_norm", "nn.functional.layer_norm"})
_LAYER_NORM_ARGUMENTS = ("normalized_shape", "weight", "bias", "eps")


def _layer_norm_bias_without_weight(case: SurveyCase) -> bool:
    """A layer norm case with a bias, no weight, and the bias among the differentiated leaves."""
    if case.opinfo.name not in _LAYER_NORMS:
        return False
    _, args, kwargs = tree_unflatten(case.leaves, case.spec)
    bound = dict(zip(_LAYER_NORM_ARGUMENTS, args, strict=False)) | dict(kwargs)
    bias = bound.get("bias")
    return bound.get("weight") is None and isinstance(bias, torch.Tensor) and any(
        case.leaves[i] is bias for i in case.diff)


def static_reason(case: SurveyCase, stack: str, dtype: torch.dtype) -> str | None:
    """Why ``stack`` cannot be checked on ``case`` at all, before running anything."""
    opinfo = case.opinfo
    if opinfo.name in UNINITIALIZED:
        return "the output is uninitialized memory: nothing to compare"
    if opinfo.name in _WRONG_NATIVE_SELF_GRADIENT and stack in REVERSE_STACKS | FORWARD_STACKS and 0 in case.diff:
        return ("native's gradient for self is wrong (PyTorch 2.13 inverts it): the reference's gradients are wrong, "
                "nothing to compare")
    if stack in DEPTH3_STACKS and _layer_norm_bias_without_weight(case):
        return ("native's double backward of layer norm with respect to a bias without a weight is zero (PyTorch "
                "2.13): the reference's second derivatives are wrong, nothing to compare")
    if (reason := _unspecified_reason(case, stack)) is not None:
        return reason
    if case.layouts - {torch.strided}:
        return f"{', '.join(sorted(str(x) for x in case.layouts - {torch.strided}))} arguments: torch.func handles " \
               "strided tensors only"
    if not case.batched:
        return "no tensor among the arguments this batching variant batches"
    if stack in REVERSE_STACKS | FORWARD_STACKS and not case.diff:
        return "no floating tensor to differentiate among the batched arguments"
    if stack in REVERSE_STACKS and not opinfo.supports_autograd:
        return "op does not support autograd"
    if stack in FORWARD_STACKS and not opinfo.supports_forward_ad:
        return "op does not support forward-mode AD"
    if stack == "jvp(grad)" and not opinfo.supports_fwgrad_bwgrad:
        return "op does not support forward-over-reverse AD"
    if stack in DEPTH3_STACKS and not opinfo.supports_gradgrad:
        return "op does not support a double backward"
    if stack in BATCHED_STACKS and case.random:
        return "random op: vmap's per-sample results follow its randomness flag, not a loop"
    return None


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
    # One op run twice: the same kernels, so the strict row (a looser one would take a small random draw for none).
    return comparison.compare(outputs[0], outputs[1], tolerance="values") is not None


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

