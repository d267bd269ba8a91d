"""Composites of the linear-algebra family: ``lu_solve``, ``linalg.lu``, ``linalg.ldl_solve``, ``linalg.tensorsolve``,
``ormqr`` and ``linalg.householder_product``.

Most are compositions of linear-algebra ops that have batching rules (``linalg.lu_factor``, ``lu_unpack``,
``linalg.solve``, ``linalg.lu_solve``) or of plain tensor ops (Householder reflectors applied one at a time, whose
backward needs no ``tril_``). ``linalg.ldl_solve`` has no derivative at all: its primitive batches by moving every vmap
dimension to the front and calling PyTorch's kernel, which takes leading batch dimensions (JAX's ``defvectorized``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from registry.core import rules
from registry.core.context import Context
from registry.core.ops import overloads
from registry.core.primitive import apply, batch_first
from registry.core.registration import define_op, register

aten = torch.ops.aten


def _loops_under_innermost_vmap(aten_name: str) -> rules.Rule:
    return rules.fails_when(rules.innermost_vmap, "slow",
                            f"{aten_name} has no batching rule, so vmap runs a per-sample loop (under autograd it "
                            "decomposes into ops that batch)")


# --- lu_solve ------------------------------------------------------------------------------------------------------

define_op("lu_solve", "", tensors=("self", "LU_data", "LU_pivots"),
          doc="the solution X of A X = self, A given by its LU factorization (LU_data, LU_pivots)",
          opinfo=("lu_solve",), rules={"native": _loops_under_innermost_vmap("aten::lu_solve")})


@register("lu_solve", "functional")
def lu_solve_functional(self, LU_data, LU_pivots):  # noqa: N803 - the schema's names
    """linalg.lu_solve with the arguments in its order (it has a batching rule)."""
    return torch.linalg.lu_solve(LU_data, LU_pivots, self)


# --- linalg.lu -----------------------------------------------------------------------------------------------------

define_op("linalg_lu", "", tensors=("A",), doc="P, L, U with A = P L U", opinfo=("linalg.lu",),
          rules={"native": rules.batched_without_batching_rule("aten::linalg_lu", "A")})


@register("linalg_lu", "functional")
def linalg_lu_functional(A, *, pivot=True):  # noqa: N803 - the schema's names
    """linalg.lu_factor, then lu_unpack (both have batching rules and derivatives)."""
    LU, pivots = torch.linalg.lu_factor(A, pivot=pivot)  # noqa: N806
    return torch.lu_unpack(LU, pivots)


# --- linalg.tensorsolve --------------------------------------------------------------------------------------------

define_op("linalg_tensorsolve", "", tensors=("self", "other"),
          doc="the X with tensordot(self, X, X.ndim) == other", opinfo=("linalg.tensorsolve",),
          rules={"native": _loops_under_innermost_vmap("aten::linalg_tensorsolve")})


@register("linalg_tensorsolve", "functional")
def linalg_tensorsolve_functional(self, other, dims=None):
    """self's dims moved last, reshaped to a square matrix, then linalg.solve (as PyTorch's own, which batches)."""
    if dims is not None:
        ndim = self.dim()
        self = self.movedim(list(dims), list(range(ndim - len(dims), ndim)))
    result_shape = self.shape[other.dim():]
    result_numel = result_shape.numel()
    if result_numel != other.numel():
        raise RuntimeError("Expected self to satisfy the requirement prod(self.shape[other.ndim:]) == "
                           f"prod(self.shape[:other.ndim]), but got {result_numel} != {other.numel()}")
    return torch.linalg.solve(self.reshape(-1, result_numel), other.reshape(-1)).reshape(result_shape)


# --- Householder reflectors: ormqr and linalg.householder_product ------------------------------------------------


def apply_reflectors(reflectors: torch.Tensor, tau: torch.Tensor, other: torch.Tensor, *, left: bool,
                     transpose: bool) -> torch.Tensor:
    """Q other (or other Q, Q^H other, other Q^H) where Q = H_1 ... H_k, H_i = I - tau_i v_i v_i^H and v_i is column
    i of ``reflectors`` below the diagonal with a 1 on it (LAPACK's geqrf layout). One reflector at a time, with
    matmul, where and indexing: all batch, and their backward needs no in-place op."""
    rows = reflectors.shape[-2]
    count = tau.shape[-1]
    position = torch.arange(rows, device=reflectors.device)
    order = range(count) if left == transpose else range(count - 1, -1, -1)
    for i in order:
        one = (position == i).to(reflectors.dtype)
        v = torch.where(position > i, reflectors[..., :, i], one)  # (..., rows)
        scale = tau[..., i, None, None]
        if transpose:
            scale = scale.conj()
        if left:  # H other = other - tau v (v^H other)
            other = other - scale * v[..., :, None] * (v.conj()[..., None, :] @ other)
        else:  # other H = other - tau (other v) v^H
            other = other - scale * (other @ v[..., :, None]) * v.conj()[..., None, :]
    return other


define_op("linalg_householder_product", "", tensors=("input", "tau"),
          doc="the first n columns of the product of the Householder reflectors stored in input and tau",
          opinfo=("linalg.householder_product",),
          rules={"native": rules.backward_without_batching_rule("aten::tril_")})


@register("linalg_householder_product", "functional")
def linalg_householder_product_functional(input, tau):
    """The reflectors applied one at a time to the first columns of the identity (no tril_ in the backward)."""
    if input.dim() < 2:
        raise RuntimeError("torch.linalg.householder_product: input must have at least 2 dimensions.")
    rows, columns = input.shape[-2], input.shape[-1]
    if rows < columns:
        raise RuntimeError("torch.linalg.householder_product: input.shape[-2] must be greater than or equal to "
                           "input.shape[-1]")
    if columns < tau.shape[-1]:
        raise RuntimeError("torch.linalg.householder_product: input.shape[-1] must be greater than or equal to "
                           "tau.shape[-1]")
    identity = torch.eye(rows, columns, dtype=input.dtype, device=input.device)
    return apply_reflectors(input, tau, identity, left=True, transpose=False)


def _ormqr_sizes(ctx: Context) -> dict[str, int] | None:
    """What vmap's loop over PyTorch's kernel and the composite's reflector products cost: the samples and the
    rows of each sample's reflectors and of the matrix they multiply; None unless all three are batched (measured
    so) and self is one (rows, columns) matrix."""
    if len(ctx.shapes) < 3 or len(ctx.shapes[0]) != 2 or set(ctx.batched) != {"self", "input2", "input3"}:
        return None
    return {"batch": ctx.batch_size, "rows": ctx.shapes[0][0], "columns": ctx.shapes[2][-1]}


define_op("ormqr", "", tensors=("self", "input2", "input3"),
          doc="input3 multiplied by the Q of a QR factorization stored as Householder reflectors (self, input2)",
          opinfo=("ormqr",),
          rules={"native": rules.fails_when(
              lambda ctx: rules.under_vmap(ctx) or "grad" in ctx.stack, "slow",
              "aten::ormqr has no batching rule (vmap loops), and its backward calls it and tril_ again (vmap(grad) "
              "and jacrev loop)")},
          # NOTE: the composite's reflector products cost more than vmap's loop over a few samples (0.4x-0.96x native
          # at batch 4-16 on OpInfo's samples, measured): chosen by cost.
          sizes=_ormqr_sizes)


@register("ormqr", "functional")
def ormqr_functional(self, input2, input3, left=True, transpose=False):
    """The reflectors applied one at a time to input3, from the side and in the order left and transpose say."""
    return apply_reflectors(self, input2, input3, left=left, transpose=transpose)


# --- linalg.ldl_solve: no derivative; batched by moving the vmap dimension to the front --------------------------


def align_batch_ranks(tensors: tuple[torch.Tensor, ...], cores: tuple[int, ...]) -> list[torch.Tensor]:
    """Tensors whose dimension 0 is the vmap dimension, with singletons inserted after it so that all have as many
    batch dimensions: the kernel broadcasts their batch shapes right-aligned, and the vmap dimension must line up."""
    batch_ranks = [t.dim() - 1 - core for t, core in zip(tensors, cores, strict=True)]
    most = max(batch_ranks)
    return [t[(slice(None),) + (None,) * (most - rank)] for t, rank in zip(tensors, batch_ranks, strict=True)]


class LdlSolve(Function):
    """linalg.ldl_solve with a vmap rule: every vmap dimension moved to the front, PyTorch's kernel once (it takes
    leading batch dimensions). PyTorch defines no derivative for it: backward and jvp raise as native does."""

    generate_vmap_rule = False

    @staticmethod
    def forward(LD: torch.Tensor, pivots: torch.Tensor, B: torch.Tensor, hermitian: bool) -> torch.Tensor:  # noqa: N803
        return aten.linalg_ldl_solve(LD, pivots, B, hermitian=hermitian)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        raise RuntimeError("the derivative for 'linalg_ldl_solve' is not implemented.")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> torch.Tensor:
        raise RuntimeError("the derivative for 'linalg_ldl_solve' is not implemented.")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], LD, pivots, B, hermitian):  # noqa: N803
        moved = batch_first(info, in_dims[:3], LD, pivots, B)
        LD, pivots, B = align_batch_ranks(tuple(moved), (2, 1, 2))  # noqa: N806
        return apply(LdlSolve, LD, pivots, B, hermitian), 0


define_op("linalg_ldl_solve", "", tensors=("LD", "pivots", "B"),
          doc="the solution X of A X = B, A given by its LDL factorization (LD, pivots)",
          opinfo=("linalg.ldl_solve",),
          rules={"native": rules.no_batching_rule("aten::linalg_ldl_solve")})


@register("linalg_ldl_solve", "primitive", function=LdlSolve)
def linalg_ldl_solve_primitive(LD, pivots, B, *, hermitian=False):  # noqa: N803
    """LdlSolve: PyTorch's kernel called once on every vmap dimension moved to the front."""
    return apply(LdlSolve, LD, pivots, B, hermitian)


# --- Fourier transforms (linear maps): fft.ihfft2, fft.ihfftn, stft -------------------------------------------------

# ihfftn(x, norm) is conj(rfftn(x)) with the normalization on the other side: "backward" (1/n on the inverse) is
# rfftn's "forward", and "ortho" stays.
_FLIPPED_NORM = {None: "forward", "backward": "forward", "forward": "backward", "ortho": "ortho"}

define_op("fft_ihfft2", "", tensors=("self",), doc="the inverse FFT of a Hermitian-symmetric signal over two dims",
          opinfo=("fft.ihfft2",), rules={"native": rules.batched_without_batching_rule("aten::fft_ihfft2", "self")})
define_op("fft_ihfftn", "", tensors=("self",), doc="the inverse FFT of a Hermitian-symmetric signal over dims",
          opinfo=("fft.ihfftn",), rules={"native": rules.batched_without_batching_rule("aten::fft_ihfftn", "self")})


def conjugate(spectrum: torch.Tensor) -> torch.Tensor:
    """The complex conjugate, materialized: the imaginary parts negated through view_as_real (conj_physical has no
    batching rule, and conj() would hand back a lazy conjugate view where native returns a plain tensor)."""
    flip = torch.tensor([1.0, -1.0], dtype=spectrum.real.dtype, device=spectrum.device)
    return torch.view_as_complex(torch.view_as_real(spectrum) * flip)


def _norm_of(norm: str | None, where: str) -> str:
    if norm not in _FLIPPED_NORM:
        raise RuntimeError(f"{where}: Invalid normalization mode: {norm}")
    return _FLIPPED_NORM[norm]


@register("fft_ihfft2", "functional")
def fft_ihfft2_functional(self, s=None, dim=(-2, -1), norm=None):
    """conj(rfft2) with the normalization on the other side (rfftn batches)."""
    if len(dim) != 2:  # PyTorch's own kernel: it accepts other counts where s says so, and raises its own error
        return aten.fft_ihfft2(self, s, dim, norm)
    return conjugate(torch.fft.rfftn(self, s, dim, norm=_norm_of(norm, "fft_ihfft2")))


@register("fft_ihfftn", "functional")
def fft_ihfftn_functional(self, s=None, dim=None, norm=None):
    """conj(rfftn) with the normalization on the other side (rfftn batches)."""
    return conjugate(torch.fft.rfftn(self, s, dim, norm=_norm_of(norm, "fft_ihfftn")))


define_op("stft", "", tensors=("self", "window"), doc="the short-time Fourier transform of self",
          opinfo=("stft",), overloads=overloads("stft", only=("stft",)),
          rules={"native": rules.batched_without_batching_rule("aten::stft", "self", "window")})


@register("stft", "functional")
def stft_functional(self, n_fft, hop_length=None, win_length=None, window=None, normalized=False, onesided=None,
                    return_complex=None, align_to_window=None):
    """Frames from unfold, times the window centred in n_fft, then rfft or fft over each frame (all batch)."""
    if align_to_window is not None:  # frames aligned to the window: left to PyTorch's kernel
        return aten.stft(self, n_fft, hop_length, win_length, window, normalized, onesided, return_complex,
                         align_to_window)
    complex_input = self.is_complex() or (window is not None and window.is_complex())
    if return_complex is None:
        if not complex_input:
            raise RuntimeError("stft requires the return_complex parameter be given for real inputs, and will "
                               "further require that return_complex=True in a future PyTorch release.")
        return_complex = True
    if self.dim() not in (1, 2):
        raise RuntimeError(f"stft: expected a 1D or 2D tensor, but got {self.dim()}D tensor")
    hop = n_fft // 4 if hop_length is None else hop_length
    win = n_fft if win_length is None else win_length
    length = self.shape[-1]
    if n_fft <= 0 or n_fft > length:
        raise RuntimeError(f"stft: expected 0 < n_fft < {length}, but got n_fft={n_fft}")
    if hop <= 0:
        raise RuntimeError(f"stft: expected hop_length > 0, but got hop_length={hop}")
    if win <= 0 or win > n_fft:
        raise RuntimeError(f"stft: expected 0 < win_length <= n_fft, but got win_length={win}")
    frames = self.unfold(-1, n_fft, hop)  # (..., frames, n_fft)
    if window is not None:
        if window.dim() != 1 or window.shape[0] != win:
            raise RuntimeError(f"stft: expected a 1D window tensor of size equal to win_length={win}, but got "
                               f"window with size {list(window.shape)}")
        left = (n_fft - win) // 2
        frames = frames * torch.nn.functional.pad(window, (left, n_fft - win - left))
    elif win < n_fft:
        left = (n_fft - win) // 2
        frames = frames * torch.nn.functional.pad(torch.ones(win, dtype=self.dtype, device=self.device),
                                                  (left, n_fft - win - left))
    norm = "ortho" if normalized else "backward"
    two_sided = complex_input if onesided is None else not onesided
    spectrum = torch.fft.fft(frames, norm=norm) if two_sided else torch.fft.rfft(frames, norm=norm)
    spectrum = spectrum.transpose(-1, -2)
    return spectrum if return_complex else torch.view_as_real(spectrum)


# --- linalg.pinv with tensor tolerances -----------------------------------------------------------------------------

def _empty_under_vmap_with_batched_tolerance(ctx: Context) -> bool:
    return rules.under_vmap(ctx) and ctx.numel == 0 and ("atol" in ctx.batched or "rtol" in ctx.batched
                                                         or "compile" in ctx.stack)


# Measured on torch 2.13: vmap over atol or rtol of the pseudo-inverse of an empty matrix returns one sample's shape
# ((0, 0) for three samples, not (3, 0, 0)): a wrong shape, silently.
define_op("linalg_pinv", "atol_rtol_tensor", tensors=("self", "atol", "rtol"),
          doc="the pseudo-inverse of self, singular values below max(atol, rtol * the largest) dropped",
          opinfo=("linalg.pinv",), overloads=overloads("linalg_pinv", only=("linalg_pinv.atol_rtol_tensor",)),
          rules={"native": rules.fails_when(
              _empty_under_vmap_with_batched_tolerance, "mismatch",
              "aten::linalg_pinv.atol_rtol_tensor under vmap over atol or rtol returns an empty self's pseudo-inverse "
              "without the batch dimension: a wrong shape")})


@register("linalg_pinv", "functional")
def linalg_pinv_functional(self, *, atol=None, rtol=None, hermitian=False):
    """PyTorch's pinv (its checks and its values); for an empty self, zeros of the transposed shape, which vmap
    gives the batch dimension that PyTorch's batching rule drops."""
    result = aten.linalg_pinv.atol_rtol_tensor(self, atol=atol, rtol=rtol, hermitian=hermitian)
    if self.numel() == 0:
        return self.new_zeros((*self.shape[:-2], self.shape[-1], self.shape[-2]))
    return result
