"""The fused primitives of masked_fill, masked_scatter and index_fill as ops of our own in C++ (the ``cpp_op`` kind):
``torch.ops.multicomposite.fill``, ``masked_scatter``, ``masked_gather`` and ``index_fill``, compiled with the routing
kernels (``registry/core/kernels/fused_ops.cpp``).

Each op has its forward (one pass on the bits, as ``composites.fused``), its autograd (a backward node that reads the
output gradient once, ``fill_backward`` and ``masked_scatter_backward``, whose own backward calls the ops again, so it
is differentiable), its forward-AD tangent and its batching rule in C++: under vmap(grad) a
call runs no Python between the composite's entry and its result, where the ``primitive`` kind's
``torch.autograd.Function`` runs its Python ``setup_context``, ``backward`` and ``vmap`` at every level. The
composites below make the same checks and the same argument adaptations as the primitives (composites/masked.py,
composites/index.py); where the C++ build is missing the kind's rule makes them invalid.
"""

from __future__ import annotations

from typing import Any

import torch

from composites import fused
from composites.checks import check_index_fill, check_masked_fill, check_masked_scatter
from composites.index import rank1_view
from composites.masked import laid_out_like, scalar_or_tensor
from registry.core.registration import register


class CppOps:
    """The C++ ops' overloads, looked up once they are registered (the extension loaded: the kind's rule loads it
    before any decision picks a cpp_op composite; a direct call loads it here)."""

    def __init__(self) -> None:
        self._ops: Any = None

    def get(self) -> Any:
        ops = self._ops
        if ops is None:
            from registry.core import kernels

            if not kernels.fused_ops_available():
                raise RuntimeError("multicomposite's C++ ops are not built in this process; build them with "
                                   f"`multicomposite build-kernels` ({kernels.HOW_TO})")
            ops = self._ops = torch.ops.multicomposite
        return ops


OPS = CppOps()


@register("masked_fill", "cpp_op")
def masked_fill_cpp_op(self, mask, value):
    """multicomposite::fill: forward, backward, tangent and batching rule in C++."""
    check_masked_fill(self, mask, value)
    return OPS.get().fill.default(self, mask, scalar_or_tensor(value, self))


@register("masked_scatter", "cpp_op")
def masked_scatter_cpp_op(self, mask, source):
    """multicomposite::masked_scatter: forward, backward (fill and masked_gather), tangent and batching rule in C++."""
    check_masked_scatter(self, mask, source)
    shape = fused.broadcast_shape(self.shape, mask.shape)
    return OPS.get().masked_scatter.default(self.expand(shape), mask.expand(shape), source, 0)


@register("index_fill", "cpp_op")
def index_fill_cpp_op(self, dim, index, value):
    """multicomposite::index_fill: fill at the index's mask (multicomposite::index_mask checks the bounds native
    checks, [-size, size), and folds negative indices, in C++ under vmap too); forward, backward, tangent and
    batching rule in C++."""
    check_index_fill(self, dim, index, value)
    flat, dim_, index_, _ = rank1_view(self, dim, index, None)
    filled = OPS.get().index_fill.default(flat, dim_, index_, scalar_or_tensor(value, self))
    return laid_out_like(filled.reshape(self.shape), self)
