"""The view-scatter family (composites/view_scatter.py): what the OpInfo coverage test cannot see.

The composites against PyTorch's own op on geometries OpInfo's samples miss (open ends, steps, negative indices, a
non-contiguous self), the two places where PyTorch 2.13 itself fails (slice_scatter's batching rule on an open end,
as_strided_scatter's missing batching rule) and the one where it is silently wrong (as_strided_scatter's gradient for
self, in eager autograd too): there each result is compared with a per-sample loop of the in-place form, whose
eager autograd (CopySlices) is right.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import func

import registry
from tests.composites.test_reduce import no_vmap_fallback

aten = torch.ops.aten
END = sys.maxsize  # what functionalization records for an open end


def _composite(op: str) -> Callable[..., torch.Tensor]:
    return registry.composites(op)["functional"].fn


SELF = torch.arange(24.0).reshape(4, 6) / 7
CASES: list[tuple[str, tuple, torch.Tensor]] = [
    ("select_scatter", (0, 2), torch.randn(6)),
    ("select_scatter", (1, -1), torch.randn(4)),
    ("slice_scatter", (1, 1, END, 1), torch.randn(4, 5)),
    ("slice_scatter", (1, 0, END, 2), torch.randn(4, 3)),
    ("slice_scatter", (0, -3, -1, 1), torch.randn(2, 6)),
    ("slice_scatter", (1, None, None, 4), torch.randn(4, 2)),
    ("diagonal_scatter", (0, 0, 1), torch.randn(4)),
    ("diagonal_scatter", (2, 1, 0), torch.randn(2)),
    ("diagonal_scatter", (-1, 0, 1), torch.randn(3)),
    ("as_strided_scatter", ((2, 3), (6, 2), 1), torch.randn(2, 3)),
    ("as_strided_scatter", ((3, 2), (1, 6), 0), torch.randn(3, 2)),
]
IDS = [f"{op}{args}" for op, args, _ in CASES]


@pytest.mark.parametrize(("op", "args", "src"), CASES, ids=IDS)
def test_composite_equals_native(op: str, args: tuple, src: torch.Tensor) -> None:
    expected = getattr(aten, op).default(SELF, src, *args)
    assert torch.equal(_composite(op)(SELF, src, *args), expected)


def test_as_strided_scatter_reads_self_storage_as_native() -> None:
    """A non-contiguous self (a transpose) and one that starts inside its storage: the view's storage positions are
    self's own, as native reads them."""
    base = torch.arange(30.0).reshape(5, 6)
    for self in (base.t(), base[1:], base[:, 1:]):
        src = torch.randn(2, 2)
        expected = torch.as_strided_scatter(self, src, (2, 2), (6, 1), self.storage_offset() + 1)
        assert torch.equal(_composite("as_strided_scatter")(self, src, (2, 2), (6, 1), self.storage_offset() + 1),
                           expected)


def test_src_of_another_size_is_refused_as_native() -> None:
    message = "expected src to have a size equal to the slice of self. src size = [5], slice size = [6]"
    with pytest.raises(RuntimeError) as native:
        torch.select_scatter(SELF, torch.randn(5), 0, 1)
    assert str(native.value) == message
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _composite("select_scatter")(SELF, torch.randn(5), 0, 1)


def _slice_open_end(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return aten.slice_scatter.default(self, src, 1, 1, END, 1).sin().sum()


def _slice_in_place(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = self.clone()
    out[:, 1:] = src
    return out.sin().sum()


SELVES = torch.randn(3, 4, 6, dtype=torch.float64)
SRCS = torch.randn(3, 4, 5, dtype=torch.float64)


def test_slice_scatter_with_an_open_end_under_vmap_grad() -> None:
    with pytest.raises(RuntimeError, match="cannot be represented as a SymInt"):
        func.vmap(func.grad(_slice_open_end, argnums=(0, 1)))(SELVES, SRCS)
    grads = []
    for self, src in zip(SELVES, SRCS, strict=True):  # per sample, eager autograd of the in-place form
        leaves = (self.clone().requires_grad_(), src.clone().requires_grad_())
        grads.append(torch.autograd.grad(_slice_in_place(*leaves), leaves))
    expected = [torch.stack([g[k] for g in grads]) for k in (0, 1)]
    with registry.use(), no_vmap_fallback():
        got = func.vmap(func.grad(_slice_open_end, argnums=(0, 1)))(SELVES, SRCS)
        tangents = func.vmap(func.jacfwd(_slice_open_end))(SELVES, SRCS)
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-15)
    torch.testing.assert_close(tangents, expected[0], rtol=0, atol=1e-15)


def _strided(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return (torch.as_strided_scatter(self, src, (2, 2), (6, 1), 1) * torch.arange(24.0).reshape(4, 6)).sin().sum()


def _strided_in_place(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The same function as PyTorch's own in-place write through the view: eager autograd's CopySlices."""
    out = self.clone()
    out.as_strided((2, 2), (6, 1), 1).copy_(src)
    return (out * torch.arange(24.0).reshape(4, 6)).sin().sum()


STRIDED_SELVES = torch.randn(3, 4, 6, dtype=torch.float64)
STRIDED_SRCS = torch.randn(3, 2, 2, dtype=torch.float64)


def _grad_loop(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    grads = []
    for self, src in zip(STRIDED_SELVES, STRIDED_SRCS, strict=True):
        leaves = (self.clone().requires_grad_(), src.clone().requires_grad_())
        grads.append(torch.autograd.grad(fn(*leaves), leaves))
    return torch.stack([g[0] for g in grads]), torch.stack([g[1] for g in grads])


def test_native_as_strided_scatter_gradient_for_self_is_wrong() -> None:
    """PyTorch 2.13 (eager autograd, no transform): the gradient for self lands where src was written."""
    x = torch.randn(4, requires_grad=True)
    out = torch.as_strided_scatter(x, torch.randn(2), (2,), (1,), 0)
    (native,) = torch.autograd.grad(out.sum(), x)
    if torch.__version__.startswith("2.13"):
        assert native.tolist() == [1.0, 1.0, 0.0, 0.0]
    with registry.use():
        out = torch.as_strided_scatter(x, torch.randn(2), (2,), (1,), 0)
        (routed,) = torch.autograd.grad(out.sum(), x)
    assert routed.tolist() == [0.0, 0.0, 1.0, 1.0]


def _jacobian_loop(stack: str) -> list:
    """Per sample, outside any transform: the in-place form's gradient, Jacobian or Hessian, by eager autograd."""
    if stack == "vmap(grad)":
        return [list(g) for g in zip(*_grad_loop(_strided_in_place), strict=True)]
    reference = torch.autograd.functional.hessian if stack == "vmap(hessian)" else torch.autograd.functional.jacobian
    return [reference(_strided_in_place, (s, r)) for s, r in zip(STRIDED_SELVES, STRIDED_SRCS, strict=True)]


TRANSFORMS = {"vmap(grad)": func.grad, "vmap(jacrev)": func.jacrev, "vmap(jacfwd)": func.jacfwd,
              "vmap(hessian)": func.hessian}


@pytest.mark.parametrize("stack", TRANSFORMS)
def test_as_strided_scatter_under_stacks_equals_the_in_place_loop(stack: str) -> None:
    transformed = func.vmap(TRANSFORMS[stack](_strided, argnums=(0, 1)))
    with pytest.raises(RuntimeError, match="as_strided_scatter requires special handling"):
        transformed(STRIDED_SELVES, STRIDED_SRCS)
    with registry.use(), no_vmap_fallback():
        got = transformed(STRIDED_SELVES, STRIDED_SRCS)
    per_sample = _jacobian_loop(stack)
    for i in range(2):
        if stack == "vmap(hessian)":
            for j in range(2):
                wanted = torch.stack([sample[i][j] for sample in per_sample])
                torch.testing.assert_close(got[i][j], wanted, rtol=0, atol=1e-13)
        else:
            torch.testing.assert_close(got[i], torch.stack([sample[i] for sample in per_sample]), rtol=0, atol=1e-13)
