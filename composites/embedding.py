"""``nn.Embedding(max_norm=...)`` under vmap: each sample reads its own rows renormed, the shared weight unwritten.

``F.embedding(input, weight, max_norm=...)`` makes two aten calls: ``embedding_renorm_(weight.detach(), input, ...)``
rescales, in place and without autograd, every row of ``weight`` that ``input`` looks up and whose norm exceeds
``max_norm`` (``row *= max_norm / (norm + 1e-7)``); then ``embedding(weight, input, ...)`` looks the rows up in
``weight`` itself. Under vmap PyTorch refuses the first where the indices are batched and the weight is not, the
per-sample-gradient case ("vmap: aten::embedding_renorm_(self, *extra_args) is not possible because there exists a
Tensor `other` in extra_args that has more elements than `self`"), and loops where the weight is batched.

What a user expects there is what a per-sample loop gives, each sample with the module as it stands: sample b reads
its own looked-up rows renormed, and no sample sees another's renorm. One weight shared by the samples cannot hold
per-sample rows, so inside ``use()``:

- weight not batched at some vmap level where the indices are (shared by the samples): ``embedding_renorm_`` writes
  nothing; it records ``(weight, max_norm, norm_type)`` on the indices tensor it was given. ``embedding`` (routed
  here too) finds the record when it is called with those same indices and the same weight (``F.embedding`` passes
  both), and renorms the rows it looked up, functionally, with PyTorch's formula: each sample its own rows, the
  weight's values and version unchanged. The renormed value enters as value only (``renormed.detach() + (rows -
  rows.detach())``): PyTorch's renorm is not differentiated, and embedding's gradient is its own (an index_add of
  the output's gradient), under grad, jvp and every nesting of them.
- weight batched wherever the indices are (an ensemble, one weight per sample): each sample's slice gets its own
  rows renormed in place, in one vectorized pass instead of vmap's loop, as a loop over the members writes each
  member's weight.

The record lives as long as the indices tensor it is attached to: a batched tensor of the transform, so nothing
outlives the transformed call, and a record no lookup reads (``embedding_renorm_`` called alone) just goes with it.
Outside vmap ``use()`` keeps PyTorch's op, which writes as natively.
"""

from __future__ import annotations

import threading

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    get_unwrapped,
    is_batchedtensor,
    maybe_get_bdim,
    maybe_get_level,
)
from torch.utils.weak import WeakIdKeyDictionary

from registry.core import rules, selector
from registry.core.context import Context, vmap_levels
from registry.core.model import Overload
from registry.core.registration import define_op, register

aten = torch.ops.aten
_LOOKUP = aten.embedding.default  # the overload itself: the packet resolves it on every call

define_op(
    "embedding_renorm_", "", tensors=("self", "indices"),
    doc="self's rows at indices rescaled in place to norm max_norm where their norm exceeds it (nn.Embedding's "
        "max_norm)",
    # One overload, routed as a functional one: the composite records or writes itself, past functorch's wrappers
    # (the router's in-place path would refuse a batched index into an unbatched self).
    overloads=(Overload(name="embedding_renorm_", inplace=False),),
    rules={"native": rules.first_of(
        rules.fails_when(lambda ctx: rules.under_vmap(ctx) and "indices" in ctx.batched and "self" not in ctx.batched,
                         "error", "vmap refuses aten::embedding_renorm_ with batched indices and an unbatched "
                                  "weight (an in-place op whose other argument has more elements than self)"),
        rules.batched_without_batching_rule("aten::embedding_renorm_", "self"))},
    generate=("native",),
)


class _Recording:
    """Whether ``embedding_renorm_`` has recorded a renorm in this process: until it does, no lookup can read one,
    and PyTorch's own ``embedding`` runs (with no Python frame: about 20 us a call less under vmap). The first record
    drops the cached decisions, so that lookups are decided again."""

    def __init__(self) -> None:
        self.seen = False

    def note(self) -> None:
        if not self.seen:
            self.seen = True
            selector.clear_cache()


_recording = _Recording()


def _may_read_a_recorded_renorm(ctx: Context) -> bool:
    """Where ``embedding_renorm_`` may have recorded its renorm instead of writing it: the indices batched where the
    weight is not, once a renorm was recorded at all. Only the innermost level's batching is known here: nested
    vmaps and torch.compile count too."""
    if not rules.under_vmap(ctx) or not _recording.seen:
        return False
    if "compile" in ctx.stack or ctx.stack.count("vmap") > 1:
        return True
    return "indices" in ctx.batched and "weight" not in ctx.batched


define_op(
    "embedding", "", tensors=("weight", "indices"),
    doc="the rows of weight at indices (nn.Embedding's lookup)",
    opinfo=("nn.functional.embedding",),
    inplace=False,
    rules={"native": rules.fails_when(
        _may_read_a_recorded_renorm, "mismatch",
        "inside use() embedding_renorm_ records its renorm instead of writing it into a weight shared by the "
        "samples; PyTorch's embedding would read those rows unrenormed")},
    generate=("native",),
)


class _Records(threading.local):
    # indices tensor -> [(the weight's storage tensor, max_norm, norm_type)], in call order; an entry goes with its
    # indices tensor.
    by_indices: WeakIdKeyDictionary | None = None


_records = _Records()


def _storage_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper of ``tensor``: ``weight.detach()`` (what F.embedding renorms)
    and ``weight`` (what it looks up in) have the same one, storage, offset, sizes and strides alike."""
    while maybe_get_level(tensor) != -1:
        try:
            tensor = get_unwrapped(tensor)
        except RuntimeError:  # a wrapper functorch cannot peel (functionalization): it stands for the weight
            break
    return tensor


def _record(indices: torch.Tensor, weight: torch.Tensor, max_norm: float, norm_type: float) -> None:
    _recording.note()
    by_indices = _records.by_indices
    if by_indices is None:
        by_indices = _records.by_indices = WeakIdKeyDictionary()
    entries = by_indices.setdefault(indices, [])
    # The plain tensor itself, not a detached alias: an op here, inside the transform, would be wrapped again.
    entries.append((_storage_tensor(weight), float(max_norm), float(norm_type)))


def _recorded(indices: torch.Tensor, weight: torch.Tensor) -> list[tuple[float, float]]:
    """The (max_norm, norm_type) recorded for ``weight`` at ``indices``, in call order."""
    by_indices = _records.by_indices
    entries = by_indices.get(indices) if by_indices else None
    if not entries:
        return []
    storage = _storage_tensor(weight)
    return [(max_norm, norm_type) for recorded, max_norm, norm_type in entries if _same_tensor(recorded, storage)]


def _same_tensor(recorded: torch.Tensor, storage: torch.Tensor) -> bool:
    """The same memory, offset, sizes and strides (``Tensor.is_set_to``, which says False for the fake and
    functional tensors torch.compile traces with: their storages are compared as aliases)."""
    return (torch._C._is_alias_of(recorded, storage) and recorded.storage_offset() == storage.storage_offset()
            and recorded.shape == storage.shape and recorded.stride() == storage.stride())


def _shared_where_indices_are_batched(weight: torch.Tensor, indices: torch.Tensor) -> bool:
    return not set(vmap_levels(indices)) <= set(vmap_levels(weight))


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
    norms = torch.linalg.vector_norm(weight, ord=norm_type, dim=-1).double()
    scale = torch.where(looked_up & (norms > max_norm), max_norm / (norms + 1e-7), torch.ones_like(norms))
    weight.mul_(scale.unsqueeze(-1).to(weight.dtype))


def _renorm_slices(weight: torch.Tensor, indices: torch.Tensor, batch_dims: int, max_norm: float,
                   norm_type: float) -> None:
    """Peel functorch's wrappers, innermost level first, keeping ``weight`` a view of the real storage: a vmap level
    where the weight is batched becomes a leading batch dimension of both (the indices' of size 1 when they are not
    batched there); a grad or jvp wrapper is unwrapped. (The caller has checked that the weight is batched wherever
    the indices are.)"""
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
            indices = get_unwrapped(indices).movedim(maybe_get_bdim(indices), 0)
        else:
            indices = get_unwrapped(indices)
    if weight_batched:
        if not indices_batched:
            indices = indices.unsqueeze(0)
        batch_dims += 1
    _renorm_slices(weight, indices, batch_dims, max_norm, norm_type)


@register("embedding_renorm_", "functional", name="per_sample")
def embedding_renorm_per_sample(self, indices, max_norm, norm_type):
    """Recorded for the lookup where the samples share the weight, written into each sample's own slice where the
    weight is batched; returns self, as PyTorch's op does."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding_renorm_: indices must be int32 or int64, got {indices.dtype}")
    if self.dim() != 2:
        raise ValueError(f"embedding_renorm_: self must be 2-D (num_embeddings, embedding_dim), got shape "
                         f"{tuple(self.shape)}")
    if _shared_where_indices_are_batched(self, indices):
        _record(indices, self, max_norm, norm_type)
    else:
        _renorm_slices(self, indices, 0, max_norm, norm_type)
    return self


def _renormed(rows: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
    """``rows`` (``..., D``) rescaled as PyTorch's kernel rescales each row in place: the norm in the rows' dtype, the
    comparison and the scale in double, the product in the rows' dtype."""
    norms = torch.linalg.vector_norm(rows, ord=norm_type, dim=-1, keepdim=True).double()
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    return rows * scale.to(rows.dtype)


@register("embedding", "functional", name="reads_recorded_renorm")
def embedding_reads_recorded_renorm(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """PyTorch's lookup, then the renorms recorded for this weight at these indices applied to the rows it read, as
    values: the gradient is the lookup's own."""
    return with_recorded_renorms(_LOOKUP(weight, indices, padding_idx, scale_grad_by_freq, sparse), weight, indices)


def with_recorded_renorms(rows: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``rows`` (``weight`` looked up at ``indices``) with the renorms recorded for that weight at those indices
    applied, as values: what a lookup reads after ``embedding_renorm_`` (``embedding``, ``embedding_bag``)."""
    recorded = _recorded(indices, weight)
    if not recorded:
        return rows
    values = rows.detach()
    renormed = values
    for max_norm, norm_type in recorded:
        renormed = _renormed(renormed, max_norm, norm_type)
    # renormed + 0: exactly the renormed values; the rows' gradient (and tangent) passes through unchanged.
    return renormed + (rows - values)
