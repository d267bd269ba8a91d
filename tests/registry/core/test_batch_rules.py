"""The C++ batching rules (``registry/core/batch_rules.py``): inside ``use()`` on the C++ backend, vmap of
``nll_loss_forward`` / ``nll_loss_backward`` runs one call of PyTorch's kernel over the folded rows instead of
functorch's Python decomposition, and vmap of ``native_group_norm`` / ``native_group_norm_backward`` one call over the
folded samples, with the same values and gradients under every transform as PyTorch's own rules; outside ``use()``, on
the Python backend and after ``uninstall()`` PyTorch's rules run."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from torch import func
from torch.nn import functional

import registry

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
