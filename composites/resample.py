"""Composites of the resampling family: ``interpolate(mode="nearest-exact")`` in 1, 2 and 3 spatial dimensions.

PyTorch 2.13 has no batching rule for ``_upsample_nearest_exact{1,2,3}d`` nor for their backward: vmap, vmap(grad),
jacrev, jacfwd and vmap(jvp) all fall back to the per-sample loop. Nearest-exact resampling is a gather along each
spatial dimension at indices that depend only on the sizes, so ``index_select`` per dimension (which batches, and
whose backward is ``index_add``, which batches too) computes it exactly.
"""

from __future__ import annotations

import math

import torch

from registry.core import rules
from registry.core.cost import batch_and_numel
from registry.core.ops import overloads
from registry.core.registration import define_op, register

_OPINFO = ("nn.functional.interpolate.nearest-exact",)


def _source_index(input_size: int, output_size: int, scale: float | None) -> torch.Tensor:
    """PyTorch's ``nearest_neighbor_exact_compute_source_index``: min(floorf((i + 0.5) * scale), input_size - 1),
    ``scale`` a float32 (1 / the given scale factor, else input_size / output_size), the product in double, rounded
    to float32 before the floor."""
    if scale is not None and scale > 0:
        ratio = torch.tensor(1.0 / scale, dtype=torch.float32)
    else:
        ratio = torch.tensor(input_size, dtype=torch.float32) / output_size
    positions = (torch.arange(output_size, dtype=torch.float64) + 0.5) * ratio.double()
    return positions.float().floor().long().clamp(max=input_size - 1)


def _nearest_exact(input: torch.Tensor, output_size, scale_factors, spatial: int) -> torch.Tensor:
    sizes = input.shape[input.dim() - spatial:]
    if output_size is not None:
        targets, scales = [int(s) for s in output_size], [None] * spatial
    else:
        # compute_output_size: the double product, truncated; the scales then reach the kernel.
        targets = [math.floor(float(size) * factor) for size, factor in zip(sizes, scale_factors, strict=True)]
        scales = list(scale_factors)
    result = input
    for axis, (size, target, scale) in enumerate(zip(sizes, targets, scales, strict=True)):
        index = _source_index(size, target, scale).to(input.device)
        result = result.index_select(input.dim() - spatial + axis, index)
    return result


for _spatial in (1, 2, 3):
    _name = f"_upsample_nearest_exact{_spatial}d"
    define_op(
        _name, "vec", tensors=("input",),
        doc=f"input resampled to output_size (or by scale_factors) with nearest-exact in {_spatial}-d",
        opinfo=_OPINFO, overloads=overloads(_name, inplace=False, only=(f"{_name}.vec",)),
        rules={"native": rules.first_of(rules.no_batching_rule(f"aten::{_name}"),
                                        rules.backward_without_batching_rule(f"aten::{_name}_backward"))},
        sizes=batch_and_numel,  # NOTE: vmap's loop beats the composite over a few small samples: by cost
    )


@register("_upsample_nearest_exact1d", "functional")
def upsample_nearest_exact1d_functional(input, output_size, scale_factors):
    """index_select along the length at the nearest-exact source indices."""
    return _nearest_exact(input, output_size, scale_factors, 1)


@register("_upsample_nearest_exact2d", "functional")
def upsample_nearest_exact2d_functional(input, output_size, scale_factors):
    """index_select along height, then width, at the nearest-exact source indices."""
    return _nearest_exact(input, output_size, scale_factors, 2)


@register("_upsample_nearest_exact3d", "functional")
def upsample_nearest_exact3d_functional(input, output_size, scale_factors):
    """index_select along depth, height, then width, at the nearest-exact source indices."""
    return _nearest_exact(input, output_size, scale_factors, 3)
