"""A result against its reference: one comparison, one tolerance table.

Every check of the harness (``checks``, ``verify``, the survey and the conformance suite, the profiles' agreement
test) compares what ran under a transform with what native PyTorch computed outside any transform through
``compare``; how close is close enough is a row of ``TOLERANCES``, chosen by what is compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

OTHER = None  # the key of a tolerance row's entry for every dtype it does not name


@dataclass(frozen=True)
class Tolerance:
    """(rtol, atol) per dtype (``OTHER`` for the rest), and whether the reference's non-finite entries count.

    ``of_largest``: ``rtol`` is relative to the reference tensor's largest finite magnitude rather than to each
    entry (a Jacobian projected on a cotangent sums terms of that size: its small entries carry their rounding).
    ``tensor_dtype``: the compared tensor's own dtype picks the entry where the row names it, even where the caller
    names the case's (a float64 OpInfo sample may hold a float32 tensor: cov's aweights).
    """

    by_dtype: Mapping[torch.dtype | None, tuple[float, float]]
    finite_only: bool = False  # True: where the reference is inf or nan there is nothing to check against
    of_largest: bool = False
    tensor_dtype: bool = False

    def bounds(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.by_dtype.get(dtype, self.by_dtype[OTHER])


# The one table. Rows by what is compared; an entry's dtype is the compared tensor's, or the case's where the caller
# names one (``compare(..., dtype=...)``).
TOLERANCES: dict[str, Tolerance] = {
    # A composite against native on the same inputs (checks, verify's matrix): torch.testing.assert_close's own
    # defaults, exact for integers and booleans.
    "values": Tolerance({
        torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
        torch.float64: (1e-7, 1e-7), torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
        torch.complex128: (1e-7, 1e-7), OTHER: (0.0, 0.0),
    }),
    # OpInfo cases under vmap alone (the survey, the conformance suite, the matrix's OpInfo ops): the op's own kernels
    # on batched memory, per entry. A sample mixed up with its neighbour differs by 5% of the value (the survey's
    # per-sample variation): per entry that is caught on the smallest entries too.
    "batched values": Tolerance({torch.float32: (1e-4, 1e-4), torch.complex64: (1e-4, 1e-4), OTHER: (1e-5, 1e-6)},
                                finite_only=True, tensor_dtype=True),
    # OpInfo cases under a stack that differentiates: gradients, double vjps and projected Jacobians go through other
    # kernels than the reference and sum terms of the size of the largest value, so relative to that value; a
    # Jacobian projected on a cotangent turns an inf into nan (0 * inf), and a double vjp overflows where the jvp does
    # not, so the reference's non-finite entries are not checked. float32 measured (docs/verification.md, Survey:
    # tolerances; ``python -m bench.survey_rounding``) against the same cases cast to float64: rounding (float64
    # agrees) reached 0.0087 of the largest value (multi_head_attention_forward, whose float32 reference is itself
    # 0.0056 from float64's) and 2.4e-4 absolute where the reference is 0 (layer_norm); a sample mixed up with its
    # neighbour differs by 0.05 of the value. float64 keeps its earlier bounds.
    "derivatives": Tolerance({torch.float32: (2e-2, 1e-3), torch.complex64: (2e-2, 1e-3), OTHER: (1e-5, 1e-6)},
                             finite_only=True, of_largest=True, tensor_dtype=True),
    # A profiled composite against the functional composite's result (either may reorder a reduction).
    "profile": Tolerance({OTHER: (1e-4, 1e-5)}),
}


@dataclass(frozen=True)
class Mismatch:
    """Where and how a result differs from its reference; the largest errors where values were compared."""

    detail: str
    max_abs_error: float | None = None
    max_rel_error: float | None = None


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max rel error) of two tensors of one shape; equal entries (nan and nan, inf and inf) count 0
    and a nan against a number counts inf."""
    if actual.numel() == 0:
        return 0.0, 0.0
    a, e = actual.detach().double(), expected.detach().double()
    same = (a == e) | (a.isnan() & e.isnan())
    diff = (a - e).abs().masked_fill(same, 0)
    diff = diff.masked_fill(diff.isnan(), math.inf)
    rel = (diff / e.abs().clamp_min(1e-12)).masked_fill(same, 0)
    rel = rel.masked_fill(rel.isnan(), math.inf)  # inf against inf of the other sign
    return diff.max().item(), rel.max().item()


def _within_largest(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
                    where: str) -> Mismatch | None:
    """Every entry within ``atol + rtol * (the largest magnitude in expected)``; integers and booleans exactly."""
    if not (expected.dtype.is_floating_point or expected.dtype.is_complex):
        if torch.equal(actual, expected):
            return None
        max_abs, max_rel = errors(actual, expected)
        return Mismatch(_prefixed(where, f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g}"), max_abs, max_rel)
    if expected.numel() == 0:
        return None
    wide = torch.complex128 if expected.dtype.is_complex else torch.float64
    a, e = actual.to(wide), expected.to(wide)
    both_nan = a.isnan() & e.isnan()
    diff = (a - e).abs().masked_fill(both_nan, 0)
    diff = diff.masked_fill(diff.isnan(), math.inf)
    if bool((diff <= atol + rtol * e.abs().max()).all()):
        return None
    max_abs, max_rel = errors(actual, expected)
    return Mismatch(_prefixed(where, f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g}"), max_abs, max_rel)


def _prefixed(where: str, text: str) -> str:
    return f"{where}: {text}" if where else text


def compare(actual: Any, expected: Any, *, tolerance: str = "values", dtype: torch.dtype | None = None,
            where: str = "output") -> Mismatch | None:
    """None when ``actual`` equals ``expected`` within ``TOLERANCES[tolerance]`` (tensors, nested sequences of
    them, or plain values), else the first difference, named by its place under ``where``.

    ``dtype`` picks the tolerance's entry (default: each tensor's own dtype).
    """
    row = TOLERANCES[tolerance]
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return Mismatch(_prefixed(where, f"expected a tensor, got {type(actual).__name__}"))
        # A sparse gradient (embedding_bag(sparse=True)'s reference) is compared by value: torch.func's are dense.
        actual, expected = (t.to_dense() if t.layout != torch.strided else t for t in (actual, expected))
        actual, expected = actual.detach(), expected.detach()
        if actual.shape != expected.shape:
            return Mismatch(_prefixed(where, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"))
        if actual.dtype != expected.dtype:
            return Mismatch(_prefixed(where, f"dtype {actual.dtype} != {expected.dtype}"))
        if row.finite_only and actual.dtype.is_floating_point:
            unchecked = ~expected.isfinite()
            actual, expected = actual.masked_fill(unchecked, 0), expected.masked_fill(unchecked, 0)
        use_tensor_dtype = dtype is None or (row.tensor_dtype and actual.dtype in row.by_dtype)
        rtol, atol = row.bounds(actual.dtype if use_tensor_dtype else dtype)
        if row.of_largest:
            return _within_largest(actual, expected, rtol, atol, where)
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            max_abs, max_rel = errors(actual, expected)
            return Mismatch(_prefixed(where, f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g}"),
                            max_abs, max_rel)
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            return Mismatch(_prefixed(where, f"expected {len(expected)} results, got {type(actual).__name__}"))
        if len(actual) != len(expected):
            return Mismatch(_prefixed(where, f"{len(actual)} results != {len(expected)}"))
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if (found := compare(a, e, tolerance=tolerance, dtype=dtype, where=f"{where}[{i}]")) is not None:
                return found
        return None
    if actual != expected:
        return Mismatch(_prefixed(where, f"{actual!r} != {expected!r}"))
    return None
