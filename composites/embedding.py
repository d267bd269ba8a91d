"""``embedding_renorm_`` (``nn.Embedding(max_norm=...)``) under vmap: each sample's rows renormed, written once.

``F.embedding(input, weight, max_norm=...)`` first rescales, in place and without autograd, every row of ``weight``
that ``input`` looks up and whose norm exceeds ``max_norm`` (``aten::embedding_renorm_``), then looks the rows up.
Under vmap PyTorch refuses it where the indices are batched and the weight is not, the per-sample-gradient case
("vmap: aten::embedding_renorm_(self, *extra_args) is not possible because there exists a Tensor `other` in
extra_args that has more elements than `self`"), and runs its per-sample loop where the weight is batched.

What a per-sample loop does: sample b renorms the rows it looks up, in the one weight, then reads them. A renormed
row has norm ``max_norm * n / (n + 1e-7) < max_norm``, so a later sample renorming it again leaves it as it is: after
the loop the weight holds every row that any sample looked up renormed once, and each sample read its own rows
renormed. The ``union_rows`` composite (the default inside ``use()``) does exactly that:

- weight not batched where the indices are (one weight shared by the samples): the rows of every sample's indices
  are renormed once, in the shared weight. Each sample's forward then reads its own rows renormed, and the weight
  ends as the loop leaves it. (Writing nothing would leave the forward reading rows that were never renormed: the
  lookup that follows reads ``weight`` itself, not the value this op returns.)
- weight batched (an ensemble, one weight per sample): each sample's slice gets its own rows renormed, in one
  vectorized pass instead of vmap's loop.

The write happens on the physical tensors with functorch's keys disabled, as PyTorch's own kernel writes below
autograd: the renorm is never differentiated, and it also reaches a weight captured from outside ``grad`` (which
PyTorch's op refuses under ``grad``: "attempted to call in-place operation ... that would mutate a captured Tensor";
outside vmap ``use()`` keeps PyTorch's op, and its error, there).
"""

from __future__ import annotations

import torch
from torch._C._functorch import get_unwrapped, is_batchedtensor, maybe_get_bdim, maybe_get_level

from registry.core import rules
from registry.core.model import Overload
from registry.core.registration import define_op, register

aten = torch.ops.aten

define_op(
    "embedding_renorm_", "", tensors=("self", "indices"),
    doc="self's rows at indices rescaled in place to norm max_norm where their norm exceeds it (nn.Embedding's "
        "max_norm)",
    # One overload, routed as a functional one: the composite writes into self itself, through functorch's wrappers
    # (the router's in-place path would refuse a batched index into an unbatched self).
    overloads=(Overload(name="embedding_renorm_", inplace=False),),
    rules={"native": rules.first_of(
        rules.fails_when(lambda ctx: rules.under_vmap(ctx) and "indices" in ctx.batched and "self" not in ctx.batched,
                         "error", "vmap refuses aten::embedding_renorm_ with batched indices and an unbatched "
                                  "weight (an in-place op whose other argument has more elements than self)"),
        rules.batched_without_batching_rule("aten::embedding_renorm_", "self"))},
    generate=("native",),
)


def _renorm_rows(weight: torch.Tensor, indices: torch.Tensor, batch_dims: int, max_norm: float,
                 norm_type: float) -> None:
    """Renorm plain ``weight`` (``*S, V, D``) in place at plain ``indices`` (``*S`` or size-1 dims, then any): slice
    s of the weight at the indices of slice s. PyTorch's formula: ``row *= max_norm / (norm + 1e-7)`` where
    ``norm > max_norm``."""
    if batch_dims == 0:
        aten.embedding_renorm_(weight, indices.reshape(-1), max_norm, norm_type)
        return
    batch = weight.shape[:batch_dims]
    flat = indices.reshape(*indices.shape[:batch_dims], -1).expand(*batch, -1)
    looked_up = torch.zeros(weight.shape[:-1], dtype=torch.bool, device=weight.device)
    looked_up.scatter_(-1, flat, True)
    norms = torch.linalg.vector_norm(weight, ord=norm_type, dim=-1)
    scale = torch.where(looked_up & (norms > max_norm), max_norm / (norms + 1e-7), torch.ones_like(norms))
    weight.mul_(scale.unsqueeze(-1).to(weight.dtype))


def _renorm(weight: torch.Tensor, indices: torch.Tensor, batch_dims: int, max_norm: float, norm_type: float) -> None:
    """Peel functorch's wrappers, innermost level first, keeping ``weight`` a view of the real storage: a vmap level
    where only the indices are batched merges that dimension into the indices (every sample's rows, once); one
    where the weight is batched becomes a leading batch dimension of both (the indices' of size 1 when they are not
    batched there); a grad or jvp wrapper is unwrapped."""
    weight_level, indices_level = maybe_get_level(weight), maybe_get_level(indices)
    level = max(weight_level, indices_level)
    if level == -1:
        with torch.no_grad(), torch._C._DisableFuncTorch():
            _renorm_rows(weight, indices, batch_dims, max_norm, norm_type)
        return
    weight_batched = weight_level == level and is_batchedtensor(weight)
    indices_batched = indices_level == level and is_batchedtensor(indices)
    if weight_level == level:
        if weight_batched:
            weight = get_unwrapped(weight).movedim(maybe_get_bdim(weight), 0)
        else:
            weight = get_unwrapped(weight)
    if indices_level == level:
        if indices_batched:
            # Batched with the weight: a leading batch dimension; without it: more indices after the batch dims.
            indices = get_unwrapped(indices).movedim(maybe_get_bdim(indices), 0 if weight_batched else batch_dims)
        else:
            indices = get_unwrapped(indices)
    if weight_batched:
        if not indices_batched:
            indices = indices.unsqueeze(0)
        batch_dims += 1
    _renorm(weight, indices, batch_dims, max_norm, norm_type)


@register("embedding_renorm_", "functional", name="union_rows")
def embedding_renorm_union_rows(self, indices, max_norm, norm_type):
    """Every sample's looked-up rows renormed once in a shared weight (what a per-sample loop leaves), or each
    sample's own in a batched weight; returns self, as PyTorch's op does."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding_renorm_: indices must be int32 or int64, got {indices.dtype}")
    if self.dim() != 2:
        raise ValueError(f"embedding_renorm_: self must be 2-D (num_embeddings, embedding_dim), got shape "
                         f"{tuple(self.shape)}")
    _renorm(self, indices, 0, max_norm, norm_type)
    return self
