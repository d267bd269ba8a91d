"""Composites of the statistics family: ``quantile`` and ``nanquantile`` (no batching rule in PyTorch 2.13, and an
in-place ``lerp_`` on the way), ``histc`` (no batching rule).

The quantile composites are PyTorch's own algorithm (``aten/src/ATen/native/Sorting.cpp``: sort along the reduced
dimension, ranks from q, gather below and above, interpolate) written in out-of-place ops that batch, with the
reduced dimension moved last: under vmap the whole batch is one sort and one gather.
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import torch
from torch._C import _DisableFuncTorch  # noqa: PLC2701 - functorch's bindings have no public API
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    _unwrap_batched as unwrap_batched,
)
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    get_unwrapped,
    is_batchedtensor,
    maybe_get_level,
)
from torch.autograd import Function

from composites.checks import check_dim
from registry.core import rules
from registry.core.context import vmap_levels
from registry.core.cost import batch_and_numel
from registry.core.disagree import SamplesDisagreeError, level_values
from registry.core.frames import calling_user_frame
from registry.core.ops import overloads as ops_overloads
from registry.core.primitive import apply
from registry.core.registration import define_op, register

aten = torch.ops.aten

_DTYPE_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
                torch.uint8: "Byte", torch.bool: "Bool"}
INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")


# --- quantile, nanquantile ---------------------------------------------------------------------------------------

define_op("quantile", "", tensors=("self", "q"), doc="the q-th quantiles of self along dim (nan if a nan is there)",
          opinfo=("quantile",), inplace=False, rules={"native": rules.no_batching_rule("aten::quantile")})
define_op("nanquantile", "", tensors=("self", "q"), doc="the q-th quantiles of self along dim, ignoring nans",
          opinfo=("nanquantile",), inplace=False, rules={"native": rules.no_batching_rule("aten::nanquantile")})


def _quantile_checks(self: torch.Tensor, q: Any, interpolation: str) -> torch.Tensor:
    """Native's checks, in native's order and words; q as a tensor of self's dtype."""
    if self.numel() == 0:
        raise RuntimeError("quantile() input tensor must be non-empty")
    if isinstance(q, torch.Tensor) and q.dim() > 1:
        raise RuntimeError("quantile() q must be a scalar or 1D tensor")
    if self.dtype not in (torch.float32, torch.float64):
        raise RuntimeError("quantile() input tensor must be either float or double dtype")
    if isinstance(q, torch.Tensor):
        if q.dtype != self.dtype:
            raise RuntimeError("quantile() q tensor must be same dtype as the input tensor")
        if q.device != self.device:
            raise RuntimeError("quantile() q tensor must be on the same device as the input tensor")
    if interpolation not in INTERPOLATIONS:
        raise RuntimeError("quantile() interpolation must be one of linear, lower, higher, midpoint or nearest, "
                           f"but got {interpolation}")
    if not isinstance(q, torch.Tensor):
        if not 0 <= q <= 1:
            raise RuntimeError(f"quantile() q must be in the range [0, 1] but got {q}")
        return torch.scalar_tensor(q, dtype=self.dtype, device=self.device)
    # A q batched by vmap has no single value to check here (the check would need .item()); native checks q on CPU.
    if q.device.type == "cpu" and not vmap_levels(q) and not bool(((q >= 0) & (q <= 1)).all()):
        raise RuntimeError("quantile() q values must be in the range [0, 1]")
    return q


def _quantile(self: torch.Tensor, q: Any, dim: int | None, keepdim: bool, interpolation: str,
              ignore_nan: bool) -> torch.Tensor:
    q_tensor = _quantile_checks(self, q, interpolation)
    rank = self.dim()
    if dim is None:
        values = self.reshape(-1)
    else:
        check_dim(self, dim)
        dim = dim % max(rank, 1)
        values = self.movedim(dim, -1) if rank else self.reshape(1)
    ordered = values.sort(-1).values  # (..., n): nans last
    q_row = q_tensor.reshape(-1)  # (k,)
    if ignore_nan:
        # Ranks over the non-nan values; all nan: rank 0, whose value is nan.
        counts = ordered.isnan().logical_not().sum(-1, keepdim=True)
        ranks = q_row * (counts - 1)
        ranks = torch.where(ranks < 0, torch.zeros((), dtype=ranks.dtype), ranks)
    else:
        # A nan anywhere: the last rank, whose value is nan.
        last = ordered.shape[-1] - 1
        ranks = torch.where(ordered.isnan().any(-1, keepdim=True), torch.full((), last, dtype=q_row.dtype),
                            q_row * last)
    if interpolation == "lower":
        ranks = ranks.floor()
    elif interpolation == "higher":
        ranks = ranks.ceil()
    elif interpolation == "nearest":
        ranks = ranks.round()
    ranks_below = ranks.long()
    result = ordered.gather(-1, ranks_below)
    if interpolation in ("linear", "midpoint"):
        weights = torch.full_like(ranks, 0.5) if interpolation == "midpoint" else ranks - ranks_below
        result = result.lerp(ordered.gather(-1, ranks.ceil().long()), weights)
    # result: (..., k) over the kept dimensions; native's shape is (k, kept...) for a 1-d q, (kept...) for a 0-d one.
    if keepdim:
        if dim is None:
            result = result.reshape(result.shape[:-1] + (1,) * rank + result.shape[-1:])
        elif rank:
            result = result.unsqueeze(dim)
    return result.squeeze(-1) if q_tensor.dim() == 0 else result.movedim(-1, 0)


@register("quantile", "functional")
def quantile_functional(self, q, dim=None, keepdim=False, *, interpolation="linear"):
    """Sort along dim, gather at the ranks below and above q * (n - 1), lerp: native's algorithm out of place."""
    return _quantile(self, q, dim, keepdim, interpolation, ignore_nan=False)


@register("nanquantile", "functional")
def nanquantile_functional(self, q, dim=None, keepdim=False, *, interpolation="linear"):
    """As quantile's, with ranks over the non-nan values of each slice."""
    return _quantile(self, q, dim, keepdim, interpolation, ignore_nan=True)


# --- histc -------------------------------------------------------------------------------------------------------

define_op("histc", "", tensors=("self",), doc="a histogram of self with bins equal-width bins over [min, max]",
          opinfo=("histc",), inplace=False, rules={"native": rules.no_batching_rule("aten::histc")},
          sizes=batch_and_numel)  # NOTE: vmap's loop beats the primitive over a few small samples: by cost


def _histc_rows(rows: torch.Tensor, bins: int, low: float, high: float) -> torch.Tensor:
    """histc of each row of ``rows`` (batch, n), the range per row as native picks it: [min, max] as given, the
    row's own extrema where min == max, widened by 1 on each side where those are equal too. Native's bin of an
    element is ``trunc((x - left) * bins / (right - left))`` in the input's dtype, the right edge in the last bin;
    elements outside the range (and nan) are not counted."""
    batch = rows.shape[0]
    if low == high and rows.shape[1] > 0:
        left, right = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)
    else:
        left = torch.full((batch, 1), low, dtype=rows.dtype, device=rows.device)
        right = torch.full((batch, 1), high, dtype=rows.dtype, device=rows.device)
    same = left == right
    left, right = torch.where(same, left - 1, left), torch.where(same, right + 1, right)
    inside = (rows >= left) & (rows <= right)
    position = ((rows - left) * bins / (right - left)).nan_to_num(0).clamp(0, bins - 1)
    position = torch.where(inside, position, torch.zeros((), dtype=rows.dtype)).long()
    counts = torch.zeros(batch, bins, dtype=rows.dtype, device=rows.device)
    return counts.scatter_add(1, position, inside.to(rows.dtype))


class Histc(Function):
    """histc with its own vmap rule: one batched binning and scatter_add over the whole batch (native's kernel
    bins one sample at a time, and vmap loops over it). Not differentiable, as natively."""

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, bins: int, low: Any, high: Any) -> torch.Tensor:
        return aten.histc(self, bins, low, high)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        raise RuntimeError("the derivative for 'histc' is not implemented.")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> torch.Tensor:
        raise RuntimeError("the derivative for 'histc' is not implemented.")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self: torch.Tensor, bins: int, low: Any,
             high: Any) -> tuple[torch.Tensor, int]:
        rows = self.movedim(in_dims[0], 0).reshape(info.batch_size, -1)
        return _histc_rows(rows, bins, float(low), float(high)), 0


@register("histc", "primitive", function=Histc)
def histc_primitive(self, bins=100, min=0, max=0):
    """Histc: under vmap, every sample binned at once (per-sample ranges where min == max) and one scatter_add."""
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    if not self.dtype.is_floating_point:
        raise RuntimeError(f'"histogram_cpu" not implemented for \'{_DTYPE_NAMES.get(self.dtype, self.dtype)}\'')
    low, high = float(min), float(max)
    if low != high and not (math.isfinite(low) and math.isfinite(high)):
        raise RuntimeError(f"torch.histc: range of [{low:g}, {high:g}] is not finite")
    if low > high:
        raise RuntimeError("torch.histc: max must be larger than min")
    # Where min == max the range is each sample's own extrema: native raises where those are not finite, which
    # cannot be checked per sample under vmap (no data-dependent control flow); such samples count no element.
    return apply(Histc, self, bins, min, max)


# --- histogram ---------------------------------------------------------------------------------------------------


define_op("histogram", "bin_ct", tensors=("self", "weight"),
          doc="a histogram of self (weighted, optionally a density) and its bin edges",
          opinfo=("histogram",), inplace=False,
          # bins_tensor passes (self, bins, *, weight, density) as they are: the bin_ct composite takes a tensor bins.
          overloads=ops_overloads("histogram", inplace=False, only=("histogram.bin_ct", "histogram.bins_tensor")),
          rules={"native": rules.no_batching_rule("aten::histogram")},
          sizes=batch_and_numel)  # NOTE: vmap's loop beats the composite over a few small samples: by cost


def _linspace(start: torch.Tensor, end: torch.Tensor, steps: int) -> torch.Tensor:
    """torch.linspace(start, end, steps) for 0-d tensor endpoints (batched ones too), in their dtype, as PyTorch's
    CPU kernel computes it: the first half start + step * i, the second end - step * (steps - 1 - i), each one fused
    multiply-add (addcmul's kernel fuses as linspace's does: equal bits on this machine's kernels, measured for 4 to
    101 steps; a build that fuses one and not the other would differ by an ulp)."""
    index = torch.arange(steps, dtype=start.dtype, device=start.device)
    step = (end - start) / max(steps - 1, 1)
    return torch.where(index < steps // 2, torch.addcmul(start, step, index),
                       torch.addcmul(end, -step, (steps - 1) - index))


def _outer_edges(values: torch.Tensor, low_high: tuple[float, float] | None, dim: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The leftmost and rightmost edge of one dimension, as 0-d tensors of ``values``' dtype: the range given, or
    the values' own extrema (per sample under vmap), widened by 0.5 on each side where they are equal."""
    dtype, device = values.dtype, values.device
    if low_high is not None:
        low, high = float(low_high[0]), float(low_high[1])
        if not (math.isfinite(low) and math.isfinite(high)):
            raise RuntimeError(f"torch.histogramdd: dimension {dim}'s range [{low:g}, {high:g}] is not finite")
        if low > high:
            raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min {low:g} max {high:g} "
                               f"for dimension {dim}")
        if low == high:
            low, high = low - 0.5, high + 0.5
        return (torch.scalar_tensor(low, dtype=dtype, device=device),
                torch.scalar_tensor(high, dtype=dtype, device=device))
    if values.numel() == 0:  # native's edges for no values: [0, 1] (measured, torch 2.13)
        return (torch.scalar_tensor(0.0, dtype=dtype, device=device),
                torch.scalar_tensor(1.0, dtype=dtype, device=device))
    # Native raises where the extrema are not finite: not checkable per sample under vmap.
    left, right = values.amin(), values.amax()
    same = left == right
    return torch.where(same, left - 0.5, left), torch.where(same, right + 0.5, right)


def _bin_positions(values: torch.Tensor, bins: Any, low_high: tuple[float, float] | None, dim: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(edges, each value's bin, whether it is counted) for one dimension, as native's histogramdd kernel bins it:
    binary search in given edges; else division checked against the neighbouring edges of a linspace
    (LINEAR_INTERPOLATION_WITH_LOCAL_SEARCH). Out-of-range values and nan are not counted; the right edge is in the
    last bin."""
    if isinstance(bins, torch.Tensor):
        edges = bins
        if edges.dim() != 1 or edges.numel() < 1:
            raise RuntimeError("torch.histogramdd(): bins tensor should have one dimension, but got "
                               f"{edges.dim()} dimensions in the bins tensor for dimension {dim}")
        count = edges.numel() - 1
        position = torch.searchsorted(edges, values.contiguous(), right=True) - 1
    else:
        if bins <= 0:
            raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension {dim}")
        count = bins
        left, right = _outer_edges(values, low_high, dim)
        edges = _linspace(left, right, count + 1)
        guess = ((values - edges[0]) * count / (edges[-1] - edges[0])).nan_to_num(0).clamp(-1, count).long()
        # The division may miss by one near an edge: the edges at guess - 1 .. guess + 1 decide, as in native.
        lowest = (guess - 1).clamp(0, count)
        near = lowest.unsqueeze(-1) + torch.arange(3, device=values.device)
        at_or_below = (edges[near.clamp_max(count)] <= values.unsqueeze(-1)) & (near <= count)
        position = lowest + at_or_below.sum(-1) - 1
    inside = (values >= edges[0]) & (values <= edges[-1])
    position = torch.where(position >= count, count - 1, position).clamp(0, max(count - 1, 0))
    return edges, position, inside


def _histogramdd(points: torch.Tensor, bins: list[Any], ranges: list[tuple[float, float] | None],
                 weight: torch.Tensor | None, density: bool, shape: tuple[int, ...],
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The histogram of ``points`` (n, d), bins and ranges per dimension: one scatter_add at the flat bin index."""
    all_edges, flat, counted = [], None, None
    for dim, (bins_d, range_d) in enumerate(zip(bins, ranges, strict=True)):
        edges, position, inside = _bin_positions(points[:, dim], bins_d, range_d, dim)
        all_edges.append(edges)
        flat = position if flat is None else flat * (edges.numel() - 1) + position
        counted = inside if counted is None else counted & inside
    sizes = [edges.numel() - 1 for edges in all_edges]
    if weight is not None and tuple(weight.shape) != shape[:-1]:
        raise RuntimeError("torch.histogramdd: if weight tensor is provided it should have the same shape as the "
                           "input tensor excluding its innermost dimension, but got input with shape "
                           f"{list(shape)} and weight with shape {list(weight.shape)}")
    dtype = points.dtype
    values = counted.to(dtype) if weight is None else torch.where(counted, weight.reshape(-1), 0)
    hist = torch.zeros(math.prod(sizes), dtype=dtype, device=points.device).scatter_add(0, flat, values)
    hist = hist.reshape(sizes)
    if density:
        hist = hist / hist.sum()
        for dim, edges in enumerate(all_edges):
            shape_d = [1] * len(sizes)
            shape_d[dim] = sizes[dim]
            hist = hist / edges.diff().reshape(shape_d)
    return hist, all_edges


@register("histogram", "functional")
def histogram_functional(self, bins=100, *, range=None, weight=None, density=False):
    """Bin edges (given, or linspace over range or self's own extrema), each element's bin by division checked against
    its neighbouring edges (native's LINEAR_INTERPOLATION_WITH_LOCAL_SEARCH) or binary search (given edges), and one
    scatter_add: out-of-place ops that batch."""
    if weight is not None:
        if weight.shape != self.shape:  # PyTorch's own kernel raises its own error
            return aten.histogram(self, bins, range=range, weight=weight, density=density) \
                if not isinstance(bins, torch.Tensor) else aten.histogram(self, bins, weight=weight, density=density)
        weight = weight.reshape(-1)  # native flattens weight with self (a 0-d self and weight included)
    hist, (edges,) = _histogramdd(self.reshape(-1, 1), [bins], [None if range is None else tuple(range)], weight,
                                  density, (*self.reshape(-1).shape, 1))
    return hist, edges.clone() if isinstance(bins, torch.Tensor) else edges


define_op("histogramdd", "", tensors=("self", "weight"),
          doc="a d-dimensional histogram of the points self (..., d) and its bin edges per dimension",
          opinfo=("histogramdd",), inplace=False,
          rules={"native": rules.no_batching_rule("aten::histogramdd", status="error",
                                                  detail="vmap raises (its bin edges are a list of tensors: no "
                                                         "fallback)")})


@register("histogramdd", "functional")
def histogramdd_functional(self, bins, range=None, weight=None, density=False):
    """histogram's binning per dimension, one scatter_add at the flat bin index: out-of-place ops that batch."""
    if self.dim() < 1:
        raise RuntimeError("torch.histogramdd: input tensor should have at least 1 dimension, but got 0")
    d = self.shape[-1]
    if isinstance(bins, int):
        bins = [bins] * d
    bins = list(bins)
    if len(bins) != d:
        raise RuntimeError(f"torch.histogramdd: expected {d} sequences of bin edges for each of the {d} "
                           f"dimensions of the input, but got {len(bins)}")
    if range is not None and len(range) != 2 * d:
        raise RuntimeError(f"torch.histogramdd: for a {d}-dimensional histogram range should have {2 * d} "
                           f"elements, but got {len(range)}")
    ranges = [None] * d if range is None else [(range[2 * k], range[2 * k + 1]) for k in builtins.range(d)]
    hist, edges = _histogramdd(self.reshape(-1, d), bins, ranges, weight, density, tuple(self.shape))
    return hist, [e.clone() if isinstance(b, torch.Tensor) else e for e, b in zip(edges, bins, strict=True)]


# --- hash_tensor: an xor reduction ---------------------------------------------------------------------------------
# hash_tensor (mode 0) xors the 64-bit patterns of the elements over dim: floats widened to float64 and read as bits,
# integers and booleans widened to int64. It has no batching rule (vmap runs a per-sample loop); the composite folds
# the reduced elements in halves with bitwise_xor, which batches: log2(n) xors of shrinking halves.

define_op("hash_tensor", "", tensors=("self",), doc="the xor of the 64-bit patterns of self's elements over dim, as "
          "uint64", opinfo=("hash_tensor",), inplace=False,
          rules={"native": rules.no_batching_rule("aten::hash_tensor")})


def _xor_fold_last(bits: torch.Tensor) -> torch.Tensor:
    """The xor over the last dimension of an int64 tensor (0 over none)."""
    while bits.shape[-1] > 1:
        if bits.shape[-1] % 2:  # 0 is xor's identity
            bits = torch.cat([bits, bits.new_zeros((*bits.shape[:-1], 1))], dim=-1)
        half = bits.shape[-1] // 2
        bits = torch.bitwise_xor(bits[..., :half], bits[..., half:])
    if bits.shape[-1] == 0:
        return bits.new_zeros(bits.shape[:-1])
    return bits[..., 0]


@register("hash_tensor", "functional")
def hash_tensor_functional(self, dim=(), *, keepdim=False, mode=0):
    """The xor of the elements' 64-bit patterns, folded in halves over the reduced dimensions moved last."""
    if mode != 0:
        raise RuntimeError(f"Unknown hash_tensor mode: {mode}")
    dims = [dim] if isinstance(dim, int) else list(dim)
    rank = max(self.dim(), 1)
    wrapped = []
    for d in dims:  # native's checks, in its words: in range, and each dimension once
        check_dim(self, d)
        if d % rank in wrapped:
            raise RuntimeError(f"dim {d % rank} appears multiple times in the list of dims")
        wrapped.append(d % rank)
    # A 0-dim self has one element whatever dim (0 or -1) names: nothing to move or fold.
    reduced = sorted(wrapped) if dims and self.dim() else list(range(self.dim()))
    # Native's checks, in its words: the xor over nothing is 0, but native refuses it.
    if not dims and self.numel() == 0:
        raise RuntimeError("hash_tensor: Expected reduction dim to be specified for input.numel() == 0. Specify the "
                           "reduction dim with the 'dim' argument.")
    for d in reduced:
        if self.dim() and self.shape[d] == 0:
            raise IndexError(f"hash_tensor: Expected reduction dim {d} to have non-zero size.")
    bits = self.to(torch.float64).view(torch.int64) if self.is_floating_point() else self.to(torch.int64)
    kept = [d for d in range(self.dim()) if d not in reduced]
    moved = bits.permute(*kept, *reduced) if self.dim() else bits
    # The reduced size spelled out: -1 cannot be inferred when a kept dimension is empty.
    folded = _xor_fold_last(moved.reshape(*(self.shape[d] for d in kept), math.prod(self.shape[d] for d in reduced)))
    if keepdim and self.dim():
        folded = folded.reshape([1 if d in reduced else self.shape[d] for d in range(self.dim())])
    return folded.view(torch.uint64)


# --- bincount ----------------------------------------------------------------------------------------------------

define_op("bincount", "", tensors=("self", "weights"),
          doc="how often each value of self (1-d, non-negative integers) occurs, or the sum of its weights",
          opinfo=("bincount",), inplace=False,
          rules={"native": rules.batched_without_batching_rule("aten::bincount", "self", "weights")})


def every_sample(tensor: torch.Tensor) -> torch.Tensor:
    """A per-sample 0-d ``tensor`` as one plain tensor of every sample's value (all vmap levels' batch dimensions):
    the functorch wrappers peeled down to the physical tensor. Read in Python, it decides what every sample shares."""
    while (level := maybe_get_level(tensor)) != -1:
        tensor = unwrap_batched(tensor, level)[0] if is_batchedtensor(tensor) else get_unwrapped(tensor)
    return tensor


def _bincount_length(self: torch.Tensor, minlength: int) -> int:
    """The one length every sample's counts have: max(largest value + 1, minlength), where that is the same in
    every sample; raises where it is not (each sample's counts would have their own length)."""
    if self.numel() == 0:
        return minlength
    lowest, largest = every_sample(self.min()), every_sample(self.max())
    if bool((lowest < 0).any()):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    top = int(largest.max()) + 1
    if minlength >= top:
        return minlength
    if int(largest.min()) + 1 != top:
        # Each sample's counts would have their own length: the vmap level splits into groups of samples whose
        # lengths agree (registry.core.batch_split), each its own vmap; the message is the error where they cannot.
        found = level_values(self.max())
        alternative = (f"pass minlength={top} or more (at least the largest value any sample can hold + 1, e.g. "
                       "the number of classes): every sample's counts then have that length")
        message = (f"bincount under vmap: the samples' counts would have different lengths (the samples' largest "
                   f"values range from {int(largest.min())} to {top - 1}, and minlength={minlength} is less than "
                   f"{top}), and one batched tensor cannot hold them. To keep one batch, {alternative}.")
        if found is None:
            raise RuntimeError(message)
        with _DisableFuncTorch():
            keys = (found.values.clamp(min=minlength - 1) + 1).reshape(*found.batch_shape, 1)
        frame = calling_user_frame()
        raise SamplesDisagreeError(message, found.levels, keys, frame.describe() if frame is not None else "",
                                   alternative)
    return top


@register("bincount", "functional")
def bincount_functional(self, weights=None, minlength=0):
    """scatter_add of ones (or the weights) at self's values into zeros of the length every sample shares, read once
    from the batched values (not differentiable, as native)."""
    if self.dim() != 1 or self.is_floating_point() or self.is_complex() or self.dtype == torch.bool:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != self.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    length = _bincount_length(self, minlength)
    if weights is None:
        dtype = torch.int64
        added = torch.ones((), dtype=dtype, device=self.device).expand(self.shape)
    else:
        dtype = weights.dtype if weights.is_floating_point() else torch.float64
        added = weights.detach().to(dtype)
    return torch.zeros(length, dtype=dtype, device=self.device).scatter_add(0, self.long(), added)
