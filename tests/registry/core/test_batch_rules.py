"""The C++ batching rules (``registry/core/batch_rules.py``): inside ``use()`` on the C++ backend, vmap of
``nll_loss_forward`` / ``nll_loss_backward`` runs one call of PyTorch's kernel over the folded rows instead of
functorch's Python decomposition, and vmap of ``native_group_norm`` / ``native_group_norm_backward`` one call over the
folded samples, vmap of convolution_backward one swapped convolution for narrow inputs, and vmap of the fused CPU
attention kernel and its backward one call each over the folded samples, with the same values and gradients under
every transform as PyTorch's own rules; outside ``use()``, under ``use(policy="native")``, on the Python backend and
after ``uninstall()`` PyTorch's rules run."""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from torch import func
from torch.nn import functional

import registry
from tests.composites.test_reduce import FALLBACK

pytestmark = pytest.mark.usefixtures("routing_backend")

BATCH, ROWS, CLASSES = 5, 3, 7
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _decompositions_run(call: Callable[[], Any]) -> list[str]:
    """The NLL decompositions of ``torch._decomp`` that ``call`` runs (their Python frames)."""
    seen: list[str] = []

    def profile(frame: FrameType, event: str, _: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name.startswith("nll_loss") and "_decomp" in code.co_filename:
            seen.append(code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(BATCH, ROWS, CLASSES, dtype=torch.float64, generator=generator)
    target = torch.randint(0, CLASSES, (BATCH, ROWS), generator=generator)
    target[1, 0] = -100  # an ignored row
    target[3, :] = -100  # a sample with every row ignored: its mean is 0 / 0
    return scores, target


def _nll(reduction: str, weight: torch.Tensor | None, ignore_index: int, one_row: bool) -> Loss:
    def loss(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if one_row:  # a 1-d input of one row: (C,) scores, a 0-d target
            scores, target = scores[0], target[0]
        return functional.nll_loss(torch.log_softmax(scores, -1), target, weight=weight, reduction=reduction,
                                   ignore_index=ignore_index).sum()

    return loss


TRANSFORMS: dict[str, Callable[[Loss], Callable[..., torch.Tensor]]] = {
    "vmap": func.vmap,
    "vmap(grad)": lambda f: func.vmap(func.grad(f)),
    "vmap(jacrev)": lambda f: func.vmap(func.jacrev(f)),
    "vmap(jacfwd)": lambda f: func.vmap(func.jacfwd(f)),
    "vmap(hessian)": lambda f: func.vmap(func.hessian(f)),
    "jacrev(vmap)": lambda f: func.jacrev(func.vmap(f)),
}
WEIGHT = torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)
CASES = list(itertools.product(("sum", "mean", "none"), (None, WEIGHT), (-100, 2), (False, True)))


def _case_id(case: tuple[str, torch.Tensor | None, int, bool]) -> str:
    reduction, weight, ignore_index, one_row = case
    return f"{reduction}-{'weight' if weight is not None else 'unweighted'}-ignore{ignore_index}-" + (
        "1d" if one_row else "2d")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_equals_pytorch_under_every_transform(case: tuple[str, torch.Tensor | None, int, bool],
                                              transform: str) -> None:
    reduction, weight, ignore_index, one_row = case
    scores, target = _inputs()
    target = torch.where(target == -100, ignore_index, target)
    run = TRANSFORMS[transform](_nll(reduction, weight, ignore_index, one_row))
    expected = run(scores, target)
    with registry.use():
        got = run(scores, target)
    torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("reduction", ("sum", "mean", "none"))
def test_per_sample_gradients_equal_the_loop(reduction: str) -> None:
    scores, target = _inputs()
    loss = _nll(reduction, WEIGHT, -100, one_row=False)
    loop = torch.stack([torch.autograd.functional.jacobian(lambda s, b=b: loss(s, target[b]), scores[b])
                        for b in range(BATCH)])
    with registry.use():
        got = func.vmap(func.grad(loss))(scores, target)
    torch.testing.assert_close(got, loop, equal_nan=True)


@pytest.mark.parametrize("in_dims", ((0, None), (None, 0)), ids=("shared-target", "shared-scores"))
def test_one_side_unbatched(in_dims: tuple[int | None, int | None]) -> None:
    scores, target = _inputs()
    target = target.clamp_min(0)
    arguments = (scores if in_dims[0] == 0 else scores[0], target if in_dims[1] == 0 else target[0])
    run = func.vmap(func.grad(_nll("mean", WEIGHT, -100, one_row=False)), in_dims=in_dims)
    expected = run(*arguments)
    with registry.use():
        got = run(*arguments)
    torch.testing.assert_close(got, expected)


def test_nested_vmap_and_cross_entropy_options() -> None:
    scores = torch.randn(2, BATCH, ROWS, CLASSES, dtype=torch.float64)
    target = torch.randint(0, CLASSES, (2, BATCH, ROWS))

    def smoothed(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(s, t, weight=WEIGHT, label_smoothing=0.1)

    run = func.vmap(func.vmap(func.grad(smoothed)))
    expected = run(scores, target)
    with registry.use():
        got = run(scores, target)
    torch.testing.assert_close(got, expected)


def test_rule_runs_instead_of_the_decomposition(routing_backend: str) -> None:
    scores, target = _inputs()
    run = func.vmap(func.grad(_nll("mean", None, -100, one_row=False)))
    outside = _decompositions_run(lambda: run(scores, target))
    with registry.use():
        inside = _decompositions_run(lambda: run(scores, target))
    assert outside == ["nll_loss_forward", "nll_loss_backward"]  # PyTorch's own, outside use()
    # The C++ rules come with the C++ routing kernels; the Python backend leaves PyTorch's decomposition in place.
    assert inside == ([] if routing_backend == "cpp" else outside)


def test_a_target_out_of_range_raises_pytorchs_error(routing_backend: str) -> None:
    scores, target = _inputs()
    target[0, 0] = CLASSES + 3
    run = func.vmap(func.grad(_nll("sum", None, -100, one_row=False)))
    # The rule's is nll_loss's own check (the error of the per-sample loop); the decomposition's is gather's.
    error = IndexError if routing_backend == "cpp" else RuntimeError
    with registry.use(), pytest.raises(error, match="out of bounds"):
        run(scores, target)


def test_uninstall_takes_the_rules_out() -> None:
    scores, target = _inputs()
    run = func.vmap(func.grad(_nll("sum", None, -100, one_row=False)))
    registry.install()
    registry.uninstall()
    try:
        assert "routing.cpp" not in torch._C._dispatch_dump("aten::nll_loss_forward")
        with registry.use():
            assert _decompositions_run(lambda: run(scores, target)) == ["nll_loss_forward", "nll_loss_backward"]
    finally:
        registry.install()


# --- group norm ------------------------------------------------------------------------------------------------------

GROUPS, GROUP_CHANNELS, SPATIAL = 2, 6, 5


def _group_norm_inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 2, GROUP_CHANNELS, SPATIAL, dtype=torch.float64, generator=generator)
    weight = torch.randn(GROUP_CHANNELS, dtype=torch.float64, generator=generator)
    bias = torch.randn(GROUP_CHANNELS, dtype=torch.float64, generator=generator)
    grad_out = torch.randn(BATCH, 2, GROUP_CHANNELS, SPATIAL, dtype=torch.float64, generator=generator)
    return x, weight, bias, grad_out


def _group_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """aten's backward itself, with its statistics from its forward: what the autograd nodes call."""
    _, mean, rstd = torch.ops.aten.native_group_norm(x, weight, None, 2, GROUP_CHANNELS, SPATIAL, GROUPS, 1e-5)
    return tuple(torch.ops.aten.native_group_norm_backward(grad_out, x, mean, rstd, weight, 2, GROUP_CHANNELS,
                                                           SPATIAL, GROUPS, [True, True, True]))


@pytest.mark.parametrize("in_dims", ((0, 0, None), (0, None, None), (None, 0, None), (0, 0, 0)),
                         ids=("both", "grad-only", "input-only", "batched-weight"))
def test_group_norm_backward_equals_the_loop(in_dims: tuple[int | None, ...]) -> None:
    """Each batching of the backward's operands (an unbatched input's statistics folded as stride-0 views were the
    case PyTorch's kernel reads wrongly unless made contiguous; a batched weight is left to functorch's rule)."""
    x, weight, _, grad_out = _group_norm_inputs()
    weights = weight.expand(BATCH, -1) * torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64)[:, None]
    operands = (grad_out, x, weights)
    loop = [_group_norm_backward(*(o[b] if d == 0 else (o[0] if o is not weights else weight)
                                   for o, d in zip(operands, in_dims, strict=True))) for b in range(BATCH)]
    arguments = tuple(o if d == 0 else (o[0] if o is not weights else weight)
                      for o, d in zip(operands, in_dims, strict=True))
    with registry.use():
        got = func.vmap(_group_norm_backward, in_dims=in_dims)(*arguments)
    for index, each in enumerate(got):
        torch.testing.assert_close(each, torch.stack([row[index] for row in loop]))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("affine", ("weight-and-bias", "weight", "neither"))
def test_group_norm_under_every_transform(affine: str, transform: str) -> None:
    x, weight, bias, _ = _group_norm_inputs()
    w = None if affine == "neither" else weight
    b = bias if affine == "weight-and-bias" else None

    def loss(sample: torch.Tensor) -> torch.Tensor:
        return (functional.group_norm(sample, GROUPS, w, b) ** 2 * torch.arange(sample.numel()).view(
            sample.shape)).sum()

    run = TRANSFORMS[transform](loss)
    expected = run(x)
    with registry.use():
        got = run(x)
    torch.testing.assert_close(got, expected)


# --- what the rules hand back to PyTorch's own rules: what the fold cannot take, and empty inputs ---------------------


def _same_outcome(run: Callable[[], Any]) -> None:
    """``run`` inside ``use()`` gives what it gives outside: the same values, or the same error type and message."""
    try:
        expected: Any = run()
    except Exception as error:  # the outcome under test may be PyTorch's own error
        with registry.use(), pytest.raises(type(error)) as raised:
            run()
        assert str(raised.value) == str(error)
        return
    with registry.use():
        got = run()
    torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("case", ("int32-target", "weight-of-wrong-size", "zero-rows", "zero-samples"))
def test_nll_loss_takes_what_pytorch_takes(case: str) -> None:
    """An int32 target (which the decomposition gathers with and the kernel refuses), a weight of the wrong size (the
    decomposition's own error), no rows and a vmap over no samples all come out as natively."""
    scores = torch.randn(0 if case == "zero-samples" else BATCH, 0 if case == "zero-rows" else ROWS, CLASSES,
                         dtype=torch.float64)
    target = torch.zeros(scores.shape[:2], dtype=torch.int32 if case == "int32-target" else torch.long)
    weight = torch.ones(CLASSES + 1 if case == "weight-of-wrong-size" else CLASSES, dtype=torch.float64)

    def loss(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return functional.nll_loss(s, t, weight=weight)

    _same_outcome(lambda: func.vmap(loss)(scores, target))
    if case != "weight-of-wrong-size":
        _same_outcome(lambda: func.vmap(func.grad(loss))(scores, target))


@pytest.mark.parametrize("shape", ((0, 2, GROUP_CHANNELS, SPATIAL), (BATCH, 0, GROUP_CHANNELS, SPATIAL),
                                   (BATCH, 2, GROUP_CHANNELS, 0)), ids=("zero-samples", "zero-N", "zero-spatial"))
def test_group_norm_of_empty_inputs(shape: tuple[int, ...]) -> None:
    """Empty inputs run PyTorch's own rules (a fold over no samples would divide by zero)."""
    _, weight, bias, _ = _group_norm_inputs()
    x = torch.randn(shape, dtype=torch.float64)

    def loss(sample: torch.Tensor) -> torch.Tensor:
        return functional.group_norm(sample, GROUPS, weight, bias).sum()

    _same_outcome(lambda: func.vmap(loss)(x))
    _same_outcome(lambda: func.vmap(func.grad(loss))(x))


# --- convolution's per-sample weight gradient --------------------------------------------------------------------

OUT_CHANNELS = 5
# (stride, padding, dilation): the swapped convolution trades stride and dilation, and keeps the first kH x kW of its
# output where the input's edge leaves more.
GEOMETRIES = ((1, 1, 1), (2, 0, 1), (1, 2, 2), (2, 1, 2), (3, 0, 1))


def _convolution_inputs(samples: int, channels: int = 3, batch: int = BATCH) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(batch, samples, channels, 9, 10, dtype=torch.float64, generator=generator)
    weight = torch.randn(OUT_CHANNELS, channels, 3, 2, dtype=torch.float64, generator=generator)
    bias = torch.randn(OUT_CHANNELS, dtype=torch.float64, generator=generator)
    return x, weight, bias


def _convolution_loss(stride: int, padding: int, dilation: int) -> Callable[..., torch.Tensor]:
    def loss(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        y = functional.conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation)
        return (y ** 2 * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum()

    return loss


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "stride{}-padding{}-dilation{}".format(*g))
@pytest.mark.parametrize("samples", (1, 2), ids=("one-sample", "two-rows-a-sample"))
@pytest.mark.parametrize("bias", (True, False), ids=("bias", "no-bias"))
def test_convolution_per_sample_gradients_equal_the_loop(geometry: tuple[int, int, int], samples: int,
                                                         bias: bool) -> None:
    """The weight's, the bias's and the input's gradients of each sample, against autograd on each sample alone."""
    x, weight, b = _convolution_inputs(samples)
    b = b if bias else None
    loss = _convolution_loss(*geometry)
    argnums = (0, 1, 2) if bias else (0, 2)
    loop = []
    for sample in x:
        leaves = [t.clone().requires_grad_() for t in (weight, b, sample) if t is not None]
        arguments = iter(leaves)
        loop.append(torch.autograd.grad(loss(next(arguments), next(arguments) if bias else None, next(arguments)),
                                        leaves))
    with registry.use():
        got = func.vmap(func.grad(loss, argnums=argnums), in_dims=(None, None, 0))(weight, b, x)
    for index, each in enumerate(got):
        torch.testing.assert_close(each, torch.stack([row[index] for row in loop]))


CONVOLUTION_TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., Any]]] = {
    "vmap(grad)": lambda f: func.vmap(func.grad(f, argnums=(0, 2)), in_dims=(None, None, 0)),
    "vmap(jacrev)": lambda f: func.vmap(func.jacrev(f, argnums=(0, 2)), in_dims=(None, None, 0)),
    "vmap(jacfwd)": lambda f: func.vmap(func.jacfwd(f, argnums=0), in_dims=(None, None, 0)),
    "vmap(hessian)": lambda f: func.vmap(func.hessian(f, argnums=0), in_dims=(None, None, 0)),
    "grad(vmap(grad))": lambda f: func.grad(lambda w, b, x: func.vmap(func.grad(f), in_dims=(None, None, 0))(
        w, b, x).pow(2).sum()),
    "vmap(vmap(grad))": lambda f: func.vmap(func.vmap(func.grad(f), in_dims=(None, None, 0)), in_dims=(None, None, 0)),
}


@pytest.mark.parametrize("transform", CONVOLUTION_TRANSFORMS)
@pytest.mark.parametrize("channels", (3, 8), ids=("narrow", "wide"))
def test_convolution_under_every_transform(transform: str, channels: int) -> None:
    """Second derivatives differentiate the swapped convolution (the rule's ops are differentiable); eight channels
    and more stay functorch's rule."""
    x, weight, bias = _convolution_inputs(1, channels)
    if transform == "vmap(hessian)":
        x, weight = x[:2, :, :, :5, :5], weight[:2]
    if transform == "vmap(vmap(grad))":
        x = x.view(1, *x.shape).expand(2, *x.shape).clone()
    loss = _convolution_loss(2, 1, 1)
    _same_outcome(lambda: CONVOLUTION_TRANSFORMS[transform](loss)(weight, bias, x))


def _convolution_backward_calls(run: Callable[[], Any]) -> int:
    with torch.profiler.profile() as profile:
        run()
    return sum(event.name == "aten::convolution_backward" for event in profile.events())


def test_convolution_rule_runs_instead_of_functorchs(routing_backend: str) -> None:
    """functorch's rule calls convolution_backward twice more on the folded samples (the input's and the weights'
    gradients); the rule once, for the input's, and a swapped convolution for the weights'."""
    x, weight, bias = _convolution_inputs(1)
    run = functools.partial(CONVOLUTION_TRANSFORMS["vmap(grad)"](_convolution_loss(1, 1, 1)), weight, bias, x)
    outside = _convolution_backward_calls(run)
    with registry.use():
        inside = _convolution_backward_calls(run)
    assert outside == 3
    assert inside == (2 if routing_backend == "cpp" else 3)


def test_convolution_of_no_samples() -> None:
    """A vmap over no samples runs functorch's rule."""
    x, weight, bias = _convolution_inputs(1, batch=0)
    _same_outcome(lambda: CONVOLUTION_TRANSFORMS["vmap(grad)"](_convolution_loss(1, 1, 1))(weight, bias, x))


def test_convolution_in_float32_is_as_accurate_as_functorchs() -> None:
    """In float32 the swapped convolution sums in another order than functorch's grouped one: both are compared with
    the float64 result, and the rule's error may not exceed twice functorch's (plus one float32 rounding)."""
    x, weight, bias = _convolution_inputs(1)
    run = CONVOLUTION_TRANSFORMS["vmap(grad)"](_convolution_loss(2, 1, 1))
    exact = run(weight, bias, x)
    singles = [t.float() for t in (weight, bias, x)]
    functorchs = run(*singles)
    with registry.use():
        got = run(*singles)
    for exact_one, functorch_one, got_one in zip(exact, functorchs, got, strict=True):
        functorch_error = (functorch_one.double() - exact_one).abs().max()
        rounding = exact_one.abs().max() * torch.finfo(torch.float32).eps
        assert (got_one.double() - exact_one).abs().max() <= 2 * functorch_error + rounding


# --- attention: the CPU flash kernel's backward over the folded samples -------------------------------------------

HEADS, LENGTH, MEMORY, HEAD_DIM = 2, 5, 4, 3
WIDTH = HEADS * HEAD_DIM
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = f"{FLASH}_backward"


def _attention_inputs(samples: int = 1, batch: int = BATCH) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(3, WIDTH, WIDTH, dtype=torch.float64, generator=generator) / WIDTH ** 0.5
    x = torch.randn(batch, samples, LENGTH, WIDTH, dtype=torch.float64, generator=generator)
    memory = torch.randn(batch, samples, MEMORY, WIDTH, dtype=torch.float64, generator=generator)
    return weight, x, memory


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(-3, -2)


def _attention(weight: torch.Tensor, x: torch.Tensor, memory: torch.Tensor, **options: Any) -> torch.Tensor:
    """SDPA of queries from ``x`` over keys and values from ``memory`` (cross-attention, so the key and value may be
    unbatched), each projection by one of ``weight``'s three matrices; ``options`` go to SDPA."""
    q, k, v = _heads(x @ weight[0]), _heads(memory @ weight[1]), _heads(memory @ weight[2])
    return functional.scaled_dot_product_attention(q, k, v, **options)


def _attention_loss(causal: bool = False, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> Callable[..., torch.Tensor]:
    """A sample's loss through ``_attention``, weighting each output element differently."""

    def loss(weight: torch.Tensor, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        y = _attention(weight, x, memory, attn_mask=mask, is_causal=causal, scale=scale)
        return (y ** 2 * torch.arange(y.numel(), dtype=y.dtype).view(y.shape).cos()).sum()

    return loss


# PyTorch's own SDPA at these sizes is auto's choice under vmap (by cost: the loop over the fused kernel costs less
# than the folded composites at batch 5), so the calls reach the fused kernel and the rules; under policy "native"
# the rules stay out (PyTorch's own rules throughout).
ATTENTION_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "scale": {"scale": 0.3},
    "float-mask": {"mask": torch.randn(1, HEADS, LENGTH, MEMORY, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(4))},
    "bool-mask": {"mask": torch.tensor([[True, False, True, True]]).expand(1, 1, LENGTH, MEMORY)},
    "2d-mask": {"mask": torch.randn(LENGTH, MEMORY, dtype=torch.float64, generator=torch.Generator().manual_seed(5))},
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("in_dims", ((None, 0, 0), (None, 0, None)), ids=("memory-batched", "memory-shared"))
def test_attention_per_sample_gradients_equal_the_loop(case: str, in_dims: tuple[int | None, ...],
                                                       routing_backend: str) -> None:
    """The weight's and the input's gradients of each sample, against autograd on each sample alone; on the C++
    backend without vmap's per-sample loop."""
    weight, x, memory = _attention_inputs()
    if in_dims[2] is None:
        memory = memory[0]
    loss = _attention_loss(**ATTENTION_CASES[case])
    loop = []
    for b, sample in enumerate(x):
        leaves = [weight.clone().requires_grad_(), sample.clone().requires_grad_()]
        loop.append(torch.autograd.grad(loss(*leaves, memory[b] if in_dims[2] == 0 else memory), leaves))
    with warnings.catch_warnings(record=True) as caught, registry.use(record=True) as run:
        warnings.simplefilter("always")
        got = func.vmap(func.grad(loss, argnums=(0, 1)), in_dims=in_dims)(weight, x, memory)
    # At these sizes the selector keeps PyTorch's own kernel (by cost): the calls reach the rules.
    assert {d.composite for d in run.decisions if d.op == "scaled_dot_product_attention"} == {"native"}
    loops = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert (loops == []) == (routing_backend == "cpp"), loops
    for index, each in enumerate(got):
        torch.testing.assert_close(each, torch.stack([row[index] for row in loop]))


ATTENTION_TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., Any]]] = {
    "vmap(grad)": lambda f: func.vmap(func.grad(f, argnums=(0, 1)), in_dims=(None, 0, 0)),
    "vmap(jacrev)": lambda f: func.vmap(func.jacrev(f, argnums=(0, 1)), in_dims=(None, 0, 0)),
    "vmap(vmap(grad))": lambda f: func.vmap(func.vmap(func.grad(f), in_dims=(None, 0, 0)), in_dims=(None, 0, 0)),
}
# Second derivatives never reach the fused kernel inside use(): natively they raise (its backward has no derivative)
# and the selector takes the functional composite there (tests/composites/test_attention.py).


@pytest.mark.parametrize("transform", ATTENTION_TRANSFORMS)
@pytest.mark.parametrize("samples", (1, 2), ids=("one-sample", "two-rows-a-sample"))
@pytest.mark.parametrize("case", ("causal", "2d-mask"))
def test_attention_under_every_transform(transform: str, samples: int, case: str) -> None:
    """The same values as functorch's loop, nested vmaps included; a 2-d mask broadcasts over both rows of a
    sample."""
    weight, x, memory = _attention_inputs(samples)
    if transform == "vmap(vmap(grad))":
        x, memory = (t.view(1, *t.shape).expand(2, *t.shape).clone() for t in (x, memory))
    loss = _attention_loss(**ATTENTION_CASES[case])
    run = functools.partial(ATTENTION_TRANSFORMS[transform](loss), weight, x, memory)
    expected = run()
    with registry.use():
        got = run()
    torch.testing.assert_close(got, expected)


def _flash_calls(run: Callable[[], Any]) -> tuple[int, int]:
    """How often ``run`` calls the fused kernel's forward and its backward."""
    with torch.profiler.profile() as profile:
        run()
    names = [event.name for event in profile.events()]
    return names.count(FLASH), names.count(FLASH_BACKWARD)


def test_attention_rules_run_instead_of_the_loop(routing_backend: str) -> None:
    """vmap's fallback calls the fused kernel and its backward once per sample (and once where it enters); the rules
    once each over the folded samples."""
    weight, x, memory = _attention_inputs()
    run = functools.partial(ATTENTION_TRANSFORMS["vmap(grad)"](_attention_loss()), weight, x, memory)
    outside = _flash_calls(run)
    with registry.use():
        inside = _flash_calls(run)
    with registry.use(policy="native"):
        native_policy = _flash_calls(run)
    assert outside == native_policy == (BATCH + 1, BATCH + 1)
    assert inside == ((2, 2) if routing_backend == "cpp" else (BATCH + 1, BATCH + 1))


@pytest.mark.parametrize("case", ("dropout", "per-sample-mask", "no-samples"))
def test_attention_edge_cases_come_out_as_natively(case: str) -> None:
    """A dropout (randomness under vmap: PyTorch's own error), a mask batched like the samples and a vmap over no
    samples come out as natively."""
    weight, x, memory = _attention_inputs(batch=0 if case == "no-samples" else BATCH)
    if case == "per-sample-mask":
        masks = torch.randn(BATCH, 1, HEADS, LENGTH, MEMORY, dtype=torch.float64)

        def masked(w: torch.Tensor, xs: torch.Tensor, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return _attention(w, xs, m, attn_mask=mask).pow(2).sum()

        _same_outcome(lambda: func.vmap(func.grad(masked), in_dims=(None, 0, 0, 0))(weight, x, memory, masks))
        return

    def loss(w: torch.Tensor, xs: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _attention(w, xs, m, dropout_p=0.5 if case == "dropout" else 0.0).pow(2).sum()

    _same_outcome(lambda: ATTENTION_TRANSFORMS["vmap(grad)"](loss)(weight, x, memory))


# --- embedding --------------------------------------------------------------------------------------------------------

TABLE_ROWS, TABLE_WIDTH = 11, 4


def _embedding_inputs(batch: int = BATCH, lookups: tuple[int, ...] = (2, 3),
                      index_dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(TABLE_ROWS, TABLE_WIDTH, dtype=torch.float64, generator=generator)
    indices = torch.randint(0, TABLE_ROWS, (batch, *lookups), generator=generator).to(index_dtype)
    if indices.numel():
        indices[0].view(-1)[:2] = 2  # a row one sample looks up twice: its gradient is a sum
        indices[1].view(-1)[0] = 2
    scale = torch.randn(*lookups, TABLE_WIDTH, dtype=torch.float64, generator=generator)
    return weight, indices, scale


def _embedding_loss(padding_idx: int | None = None, scale_grad_by_freq: bool = False,
                    constant_gradient: bool = False) -> Callable[..., torch.Tensor]:
    def loss(weight: torch.Tensor, indices: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows = functional.embedding(indices, weight, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        # A constant output gradient (the rows summed) reaches the backward unbatched; tanh's is per sample.
        return rows.sum() if constant_gradient else (rows.tanh() * scale).sum()

    return loss


EMBEDDING_TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., Any]]] = {
    "vmap(grad)": lambda f: func.vmap(func.grad(f), in_dims=(None, 0, None)),
    "vmap(jacrev)": lambda f: func.vmap(func.jacrev(f), in_dims=(None, 0, None)),
    "vmap(jacfwd)": lambda f: func.vmap(func.jacfwd(f), in_dims=(None, 0, None)),
    "vmap(hessian)": lambda f: func.vmap(func.hessian(f), in_dims=(None, 0, None)),
    "grad(vmap(grad))": lambda f: func.grad(lambda w, i, s: func.vmap(func.grad(f), in_dims=(None, 0, None))(
        w, i, s).pow(2).sum()),
    "vmap(vmap(grad))": lambda f: func.vmap(func.vmap(func.grad(f), in_dims=(None, 0, None)), in_dims=(None, 0, None)),
    # The rule declines at the inner levels here, where the operands are still wrapped by the outer ones.
    "vmap(jacrev(grad))": lambda f: func.vmap(func.jacrev(func.grad(f)), in_dims=(None, 0, None)),
}
EMBEDDING_CASES = ("plain", "padding-row", "constant-gradient", "int32-indices", "scaled-by-frequency")


def _embedding_case(case: str) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    inputs = _embedding_inputs(index_dtype=torch.int32 if case == "int32-indices" else torch.long)
    loss = _embedding_loss(padding_idx=2 if case == "padding-row" else None,
                           scale_grad_by_freq=case == "scaled-by-frequency",
                           constant_gradient=case == "constant-gradient")
    return loss, inputs


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_embedding_per_sample_gradients_equal_the_loop(case: str) -> None:
    """Each sample's gradient of the shared table equals torch.autograd's over that sample alone: the rows it looked
    up twice summed, its padding row zero, each row scaled by its count in the sample where asked."""
    loss, (weight, indices, scale) = _embedding_case(case)
    loop = []
    for sample in indices:
        table = weight.clone().requires_grad_()
        loop.append(torch.autograd.grad(loss(table, sample, scale), table)[0])
    with registry.use():
        got = EMBEDDING_TRANSFORMS["vmap(grad)"](loss)(weight, indices, scale)
    torch.testing.assert_close(got, torch.stack(loop))


@pytest.mark.parametrize("transform", EMBEDDING_TRANSFORMS)
@pytest.mark.parametrize("case", ("plain", "padding-row", "constant-gradient"))
def test_embedding_under_every_transform(case: str, transform: str) -> None:
    loss, (weight, indices, scale) = _embedding_case(case)
    if transform == "vmap(vmap(grad))":
        indices = indices.view(1, *indices.shape).expand(2, *indices.shape).clone()
    _same_outcome(lambda: EMBEDDING_TRANSFORMS[transform](loss)(weight, indices, scale))


@pytest.mark.parametrize("case", ("no-samples", "no-lookups", "index-out-of-range"))
def test_embedding_edge_cases_come_out_as_natively(case: str) -> None:
    """A vmap over no samples, samples that look nothing up and an index past the table (embedding's own error) come
    out as natively."""
    weight, indices, scale = _embedding_inputs(batch=0 if case == "no-samples" else BATCH,
                                               lookups=(0,) if case == "no-lookups" else (2, 3))
    if case == "index-out-of-range":
        indices[1, 0, 0] = TABLE_ROWS
    _same_outcome(lambda: EMBEDDING_TRANSFORMS["vmap(grad)"](_embedding_loss())(weight, indices, scale))


# --- layer norm -------------------------------------------------------------------------------------------------------

NORMALIZED = (3, 4)


def _layer_norm_inputs(batch: int = BATCH, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(batch, 2, *NORMALIZED, dtype=dtype, generator=generator)
    weight = torch.randn(*NORMALIZED, dtype=dtype, generator=generator)
    bias = torch.randn(*NORMALIZED, dtype=dtype, generator=generator)
    scale = torch.randn(2, *NORMALIZED, dtype=dtype, generator=generator)
    return weight, bias, x, scale


def _layer_norm_loss(affine: str) -> Callable[..., torch.Tensor]:
    def loss(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        w = weight if affine in ("weight-and-bias", "weight") else None
        b = bias if affine in ("weight-and-bias", "bias") else None
        return (functional.layer_norm(x, NORMALIZED, w, b).tanh() * scale).sum()

    return loss


LAYER_NORM_TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., Any]]] = {
    "vmap(grad)": lambda f: func.vmap(func.grad(f, argnums=(0, 1, 2)), in_dims=(None, None, 0, None)),
    "vmap(grad)-input-only": lambda f: func.vmap(func.grad(f, argnums=2), in_dims=(None, None, 0, None)),
    "vmap(jacrev)": lambda f: func.vmap(func.jacrev(f, argnums=(0, 1)), in_dims=(None, None, 0, None)),
    "vmap(jacfwd)": lambda f: func.vmap(func.jacfwd(f, argnums=0), in_dims=(None, None, 0, None)),
    "vmap(hessian)": lambda f: func.vmap(func.hessian(f, argnums=0), in_dims=(None, None, 0, None)),
    "vmap(jacrev(grad))": lambda f: func.vmap(func.jacrev(func.grad(f)), in_dims=(None, None, 0, None)),
    "grad(vmap(grad))": lambda f: func.grad(lambda w, b, x, s: func.vmap(func.grad(f), in_dims=(None, None, 0, None))(
        w, b, x, s).pow(2).sum()),
    "vmap(vmap(grad))": lambda f: func.vmap(func.vmap(func.grad(f, argnums=(0, 1)), in_dims=(None, None, 0, None)),
                                            in_dims=(None, None, 0, None)),
    "ensemble": lambda f: func.vmap(func.grad(f, argnums=(0, 1)), in_dims=(0, 0, 0, None)),
}


@pytest.mark.parametrize("affine", ("weight-and-bias", "weight", "bias", "neither"))
def test_layer_norm_per_sample_gradients_equal_the_loop(affine: str) -> None:
    """Each sample's gradients of the shared weight and bias, and of its input, equal torch.autograd's over that
    sample alone."""
    weight, bias, x, scale = _layer_norm_inputs()
    loss = _layer_norm_loss(affine)
    loop = []
    for sample in x:
        leaves = (weight.clone().requires_grad_(), bias.clone().requires_grad_(), sample.clone().requires_grad_())
        loop.append(torch.autograd.grad(loss(*leaves, scale), leaves, allow_unused=True, materialize_grads=True))
    with registry.use():
        got = LAYER_NORM_TRANSFORMS["vmap(grad)"](loss)(weight, bias, x, scale)
    for index, each in enumerate(got):
        torch.testing.assert_close(each, torch.stack([row[index] for row in loop]))


@pytest.mark.parametrize("transform", LAYER_NORM_TRANSFORMS)
@pytest.mark.parametrize("affine", ("weight-and-bias", "neither"))
def test_layer_norm_under_every_transform(affine: str, transform: str) -> None:
    weight, bias, x, scale = _layer_norm_inputs()
    if transform == "vmap(vmap(grad))":
        x = x.view(1, *x.shape).expand(2, *x.shape).clone()
    if transform == "ensemble":
        weight, bias = weight.expand(BATCH, *NORMALIZED).clone(), bias.expand(BATCH, *NORMALIZED).clone()
    _same_outcome(lambda: LAYER_NORM_TRANSFORMS[transform](_layer_norm_loss(affine))(weight, bias, x, scale))


@pytest.mark.parametrize("case", ("no-samples", "float32", "mixed-dtypes"))
def test_layer_norm_edge_cases_come_out_as_natively(case: str) -> None:
    """A vmap over no samples, float32 (the rule's sums in double: within float32's tolerance of functorch's) and a
    weight of another dtype than the input (PyTorch's own error) come out as natively."""
    weight, bias, x, scale = _layer_norm_inputs(batch=0 if case == "no-samples" else BATCH,
                                                dtype=torch.float32 if case == "float32" else torch.float64)
    if case == "mixed-dtypes":
        weight = weight.float()
    _same_outcome(lambda: LAYER_NORM_TRANSFORMS["vmap(grad)"](_layer_norm_loss("weight-and-bias"))(weight, bias, x,
                                                                                                    scale))


def test_layer_norm_rule_runs_instead_of_functorchs(routing_backend: str) -> None:
    """functorch's rule multiplies the output gradient by the weight as a batched op before PyTorch's kernel and
    forms the weight's gradient from batched temporaries; the rule calls the kernel with the weight inside it."""
    weight, bias, x, scale = _layer_norm_inputs()
    run = functools.partial(LAYER_NORM_TRANSFORMS["vmap(grad)"](_layer_norm_loss("weight-and-bias")), weight, bias, x,
                            scale)

    def multiplies() -> int:
        with torch.profiler.profile() as profile:
            run()
        return sum(event.name == "aten::mul" for event in profile.events())

    outside = multiplies()
    with registry.use():
        inside = multiplies()
    # The loss's own: tanh's backward and the scale, forward and backward; functorch's rule adds grad_out * weight and
    # the weight gradient's two products.
    assert outside - inside == (3 if routing_backend == "cpp" else 0)


# --- the kernels under the last level (batch_rules.cpp: NOTE [kernels under the last level]) ------------------------


def _causal_attention_operands() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn(BATCH, 1, 2, 6, 4, generator=generator) for _ in range(3))


def _causal_attention_loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return functional.scaled_dot_product_attention(q, k, v, is_causal=True).tanh().sum()


def test_eager_autograd_records_through_the_rules() -> None:
    """A weight that requires grad outside every transform: the rules' kernels (the NLL loss's, forward and backward)
    run with the keys the call came in with, so eager autograd records them as it does natively (the second
    derivative equals PyTorch's)."""
    generator = torch.Generator().manual_seed(5)
    x, target = torch.randn(BATCH, 4, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)
    weight = torch.randn(CLASSES, 4, generator=generator)

    def loss(w: torch.Tensor, sample: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy((sample @ w.T).unsqueeze(0), label.unsqueeze(0))

    def outer(w: torch.Tensor) -> torch.Tensor:
        per_sample = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(w, x, target)
        return torch.autograd.grad(per_sample.square().sum(), w)[0]

    native = outer(weight.clone().requires_grad_())
    with registry.use():
        routed = outer(weight.clone().requires_grad_())
    torch.testing.assert_close(routed, native)


def test_autocast_casts_inside_the_rules() -> None:
    """Under CPU autocast the kernels a rule calls are cast as they are natively (linear in bfloat16)."""
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(BATCH, 3, 8, generator=generator), torch.randn(6, 8, generator=generator)

    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return func.vmap(lambda sample: functional.linear(sample, weight))(x)

    native = run()
    with registry.use():
        routed = run()
    assert routed.dtype == native.dtype == torch.bfloat16
    torch.testing.assert_close(routed, native)


def test_levels_below_keep_the_fallback() -> None:
    """With a level below the rule's (grad(vmap), vmap(vmap(grad))), every op goes through functorch as before: the
    values equal PyTorch's rules'."""
    q, k, v = _causal_attention_operands()
    calls: dict[str, Callable[[], Any]] = {
        "grad(vmap)": lambda: func.grad(lambda t: func.vmap(_causal_attention_loss)(t, k, v).sum())(q),
        "vmap(vmap(grad))": lambda: func.vmap(func.vmap(func.grad(_causal_attention_loss)))(
            q.unsqueeze(1).expand(BATCH, 2, 1, 2, 6, 4), k.unsqueeze(1).expand(BATCH, 2, 1, 2, 6, 4),
            v.unsqueeze(1).expand(BATCH, 2, 1, 2, 6, 4)),
    }
    for name, call in calls.items():
        native = call()
        with registry.use():
            routed = call()
        torch.testing.assert_close(routed, native, msg=name)
