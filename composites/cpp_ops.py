"""The fused primitives of masked_fill, masked_scatter and index_fill as ops of our own in C++ (the ``cpp_op`` kind):
``torch.ops.multicomposite.fill``, ``masked_scatter``, ``masked_gather`` and ``index_fill``, compiled with the routing
kernels (``registry/core/kernels/fused_ops.cpp``).

Each op has its forward (one pass on the bits, as ``composites.fused``), its autograd (a backward node that reads the
output gradient once, ``fill_backward`` and ``masked_scatter_backward``, whose own backward calls the ops again, so it
is differentiable), its forward-AD tangent and its batching rule in C++: under vmap(grad) a
call runs no Python between the composite's entry and its result, where the ``primitive`` kind's
``torch.autograd.Function`` runs its Python ``setup_context``, ``backward`` and ``vmap`` at every level. Where the
C++ build is missing the kind's rule makes them invalid.

The composites are their entry ops (``multicomposite::masked_fill.Scalar``/``.Tensor``,
``index_fill.int_Scalar``/``.int_Tensor``, ``masked_scatter.entry``; registry/core/kernels/entries.cpp), which take
aten's arguments and adapt them in C++ as the primitives do in Python (composites/masked.py, composites/index.py),
handing what PyTorch rejects to PyTorch's own op. Declared with ``redirect=``, the C++ routing calls them where a
decision picks the composite, so such a routed call never enters Python.
"""

from __future__ import annotations

import torch

import composites.index  # noqa: F401 - defines index_fill, whose composite this module adds (define_op first)
import composites.masked  # noqa: F401 - defines masked_fill and masked_scatter
from composites.our_ops import OPS
from registry.core.registration import register


@register("masked_fill", "cpp_op", redirect="multicomposite::masked_fill")
def masked_fill_cpp_op(self, mask, value):
    """multicomposite::fill: forward, backward, tangent and batching rule in C++, entered through
    multicomposite::masked_fill (aten's arguments, PyTorch's checks; registry/core/kernels/entries.cpp)."""
    entry = OPS.get().masked_fill
    return (entry.Tensor if isinstance(value, torch.Tensor) else entry.Scalar)(self, mask, value)


@register("masked_scatter", "cpp_op", redirect="multicomposite::masked_scatter.entry")
def masked_scatter_cpp_op(self, mask, source):
    """multicomposite::masked_scatter: forward, backward (fill and masked_gather), tangent and batching rule in C++,
    entered through aten's arguments and PyTorch's checks (multicomposite::masked_scatter.entry, entries.cpp)."""
    return OPS.get().masked_scatter.entry(self, mask, source)


@register("index_fill", "cpp_op", redirect="multicomposite::index_fill")
def index_fill_cpp_op(self, dim, index, value):
    """multicomposite::index_fill: fill at the index's mask (multicomposite::index_mask checks the bounds native
    checks, [-size, size), and folds negative indices, in C++ under vmap too); forward, backward, tangent and
    batching rule in C++, entered through aten's arguments and PyTorch's checks (entries.cpp)."""
    entry = OPS.get().index_fill
    return (entry.int_Tensor if isinstance(value, torch.Tensor) else entry.int_Scalar)(self, dim, index, value)
