"""Composites of the flat-index family: ``take``, ``put``, ``embedding_bag``, ``one_hot``, and ``index_put``
(``buf[idx] = v``) under forward-mode AD."""

from __future__ import annotations

import math

import torch

from composites.embedding import with_recorded_renorms
from composites.statistics import every_sample
from registry.core import inplace_under_jvp, rules
from registry.core.cost import batch_and_numel
from registry.core.ops import overloads
from registry.core.registration import define_op, register

aten = torch.ops.aten

define_op(
    "take", "", tensors=("self", "index"), doc="self's elements at the flat indices index", opinfo=("take",),
    inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::take"),
                                    rules.backward_without_batching_rule("aten::put_"))},
)


@register("take", "functional")
def take_functional(self, index):
    """self flattened, indexed by index: advanced indexing batches, and its backward is index_put."""
    if self.numel() == 0 or index.numel() == 0:
        # An empty self or index: reshape(-1) of zero elements under vmap is ambiguous, and indexing an empty self
        # fails to broadcast; PyTorch's own kernel returns the empty result (or its own error).
        return aten.take(self, index)
    return self.reshape(-1)[index]


define_op(
    "put", "", tensors=("self", "index", "source"), doc="self with source written (or added) at the flat indices index",
    opinfo=("put",), inplace=False,
    # put has no batching rule, and its backward calls put and take (source's gradient), which have none either.
    rules={"native": rules.first_of(rules.no_batching_rule("aten::put"),
                                    rules.backward_without_batching_rule("aten::take"))},
    sizes=batch_and_numel,  # NOTE: vmap's loop beats the composite over a few small samples: by cost
)


@register("put", "functional")
def put_functional(self, index, source, accumulate=False):
    """self flattened, index_put at the flat indices: index_put batches, and its backward is indexing."""
    flat = self.reshape(-1).index_put((index.reshape(-1),), source.reshape(-1), accumulate)
    return flat.reshape(self.shape)


define_op(
    "embedding_bag", "padding_idx", tensors=("weight", "indices", "offsets", "per_sample_weights"),
    doc="weight's rows at indices, reduced (sum, mean, max) per bag that offsets start",
    opinfo=("nn.functional.embedding_bag",), overloads=overloads("embedding_bag", only=("embedding_bag.padding_idx",)),
    rules={"native": rules.first_of(rules.no_batching_rule("aten::embedding_bag.padding_idx"),
                                    rules.backward_without_batching_rule("aten::_embedding_bag_backward"))},
)

_SUM, _MEAN, _MAX = 0, 1, 2


@register("embedding_bag", "functional")
def embedding_bag_functional(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                             include_last_offset, padding_idx):
    """weight[indices] reduced with scatter_add / scatter_reduce over each index's bag (offsets compared with its
    position); the other three outputs as PyTorch's CPU kernel returns them. ``sparse`` gradients are dense here."""
    if indices.dim() != 1 or offsets.dim() != 1 or mode not in (_SUM, _MEAN, _MAX):
        # PyTorch's own checks, so that the error is the same
        return aten.embedding_bag.padding_idx(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
                                              per_sample_weights, include_last_offset, padding_idx)
    count, width = indices.shape[0], weight.shape[1]
    # include_last_offset: the last offset closes the last bag, yet PyTorch's kernel puts indices past it there too.
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    positions = torch.arange(count, device=indices.device)
    bag = (offsets[1:max(bags, 1)].unsqueeze(-1) <= positions).sum(-2)  # how many later bags start at or before it
    padding = None if padding_idx is None else padding_idx % weight.shape[0] if padding_idx < 0 else padding_idx
    kept = torch.ones_like(indices, dtype=torch.bool) if padding is None else indices != padding
    # PyTorch's CPU kernel has a fast path for sum over float, half and bfloat16 without padding_idx: it leaves
    # offset2bag empty. (With include_last_offset, indices past the last offset, which the documentation rules out,
    # go to the last bag as the other paths put them; the fast path's value leaves them out, its gradient does not.)
    fast = mode == _SUM and padding is None and weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
    # F.embedding_bag(max_norm=...) renormed these rows first; under vmap with a weight the samples share, the
    # renorm was recorded, not written (composites/embedding.py), and is read here.
    rows = with_recorded_renorms(weight[indices], weight, indices)
    if scale_grad_by_freq and mode != _MAX:
        # The value is rows; the gradient of each row is divided by a frequency, chosen as PyTorch's CPU backward
        # chooses it (_embedding_bag_dense_backward_cpu_sum_mean): the i-th distinct index, in sorted order, takes
        # the count of the i-th element of the sorted indices. That is the index's own count only where no index
        # repeats (nn.functional.embedding divides by the index's own count).
        scale = _frequency_scale(weight, indices)
        rows = rows * scale + (rows * (1 - scale)).detach()
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1)
    rows = torch.where(kept.unsqueeze(-1), rows, 0)
    target = bag.unsqueeze(-1).expand(count, width)
    empty = weight.new_zeros(bags, width)
    sizes = torch.zeros(bags, dtype=indices.dtype, device=indices.device).scatter_add(0, bag,
                                                                                      kept.to(indices.dtype))
    if mode == _MAX:
        # Padding rows never win: -inf there; an empty bag stays 0 (include_self=False keeps the base).
        rows = torch.where(kept.unsqueeze(-1), rows, -math.inf)
        output = empty.scatter_reduce(0, target, rows, "amax", include_self=False)
        output = torch.where((sizes > 0).unsqueeze(-1), output, 0)  # a bag of padding only: 0, not -inf
    else:
        output = empty.scatter_add(0, target, rows)
        if mode == _MEAN:
            output = output / sizes.clamp(min=1).unsqueeze(-1).to(weight.dtype)
    if mode == _SUM:
        # bag_size and max_indices are zero for sum, one per offset.
        unused = indices.new_zeros(offsets.shape[0])
        return output, indices.new_zeros(0) if fast else bag, unused, unused.clone()
    if mode == _MEAN:
        return output, bag, sizes, sizes.clone()
    return output, bag, sizes, _max_indices(rows.detach(), output.detach(), indices, target, bags)


def _frequency_scale(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per position of indices, the factor PyTorch's CPU backward applies to its gradient under scale_grad_by_freq."""
    counts = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device).scatter_add(
        0, indices, torch.ones_like(indices, dtype=weight.dtype))
    rank = torch.cumsum((counts > 0).to(indices.dtype), 0) - 1  # each present index's rank among the distinct ones
    ordered = torch.sort(indices).values
    frequency = counts[ordered[rank.clamp(min=0, max=indices.shape[0] - 1)]]
    return (1 / frequency[indices]).unsqueeze(-1)


def _max_indices(rows: torch.Tensor, output: torch.Tensor, indices: torch.Tensor, target: torch.Tensor,
                 bags: int) -> torch.Tensor:
    """Per bag and column, the index (a row of weight) of the first position that holds the maximum; 0 for an empty
    bag, as PyTorch's CPU kernel returns it."""
    count = indices.shape[0]
    wins = rows == output.gather(0, target)
    position = torch.where(wins, torch.arange(count, device=indices.device).unsqueeze(-1), count)
    first = torch.full_like(output, count, dtype=indices.dtype).scatter_reduce(0, target, position, "amin",
                                                                               include_self=True)
    return torch.where(first < count, indices[first.clamp(max=max(count - 1, 0))], 0)


define_op(
    "nonzero_static", "", tensors=("self",), doc="the indices of self's first size nonzero elements, fill_value after",
    opinfo=("nonzero_static",), inplace=False, rules={"native": rules.no_batching_rule("aten::nonzero_static")},
    sizes=batch_and_numel,  # NOTE: vmap's loop beats the composite over a few small samples: by cost
)


@register("nonzero_static", "functional")
def nonzero_static_functional(self, *, size, fill_value=-1):
    """Each nonzero element's rank (a cumsum) is its row: its flat position scattered there, then unravelled."""
    if size < 0:
        return aten.nonzero_static(self, size=size, fill_value=fill_value)  # PyTorch's own error
    nonzero = (self != 0).reshape(-1)
    count = nonzero.shape[0]
    rank = torch.cumsum(nonzero.to(torch.int64), 0) - 1
    # Rows past size, and zeros, go to one extra row that is dropped.
    row = torch.where(nonzero & (rank < size), rank, size)
    positions = torch.arange(count, device=self.device)
    picked = torch.full((size + 1,), -1, dtype=torch.int64, device=self.device).scatter(0, row, positions)[:size]
    if self.dim() == 0:
        return torch.zeros((size, 0), dtype=torch.int64, device=self.device)
    if count == 0:  # nothing to unravel (an extent is 0): every row is fill_value
        return torch.full((size, self.dim()), fill_value, dtype=torch.int64, device=self.device)
    coordinates, rest = [], picked
    for extent in reversed(self.shape):
        coordinates.append(rest % extent)
        rest = rest // extent
    found = torch.stack(coordinates[::-1], -1)
    return torch.where((picked >= 0).unsqueeze(-1), found, fill_value)


# --- one_hot ----------------------------------------------------------------------------------------------------------

def _one_hot_checks_batched_labels(ctx: rules.Context) -> bool:
    """The labels are batched and the call lands on a grad or jvp level inside vmap: one_hot's CompositeImplicit
    kernel runs there, and its bounds checks (``self.min().item()``) meet the batched labels; functorch's own
    decomposition (no .item()) applies only where vmap is the innermost transform."""
    return bool(ctx.stack) and ctx.stack[-1] != "vmap" and "vmap" in ctx.stack and (
        "self" in ctx.batched or ctx.stack.count("vmap") > 1)


define_op(
    "one_hot", "", tensors=("self",), doc="self's class indices as one-hot rows of num_classes (int64)",
    opinfo=("nn.functional.one_hot",), inplace=False,
    rules={"native": rules.fails_when(
        _one_hot_checks_batched_labels, "error",
        "aten::one_hot checks the labels' bounds with .item(), which vmap refuses, under a grad or jvp level inside "
        "vmap (per-sample gradients of a loss with one-hot targets)")},
)


@register("one_hot", "functional")
def one_hot_functional(self, num_classes=-1):
    """Zeros of self's shape and num_classes, with a 1 scattered at each label: functorch's own decomposition of
    one_hot under vmap, which leaves the bounds to scatter's checks instead of native's .item() (num_classes=-1 still
    reads the largest label, as native does)."""
    if self.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes == -1:
        if self.numel() == 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        num_classes = int(self.max().item()) + 1
    return torch.zeros((*self.shape, num_classes), dtype=torch.long, device=self.device).scatter(
        -1, self.unsqueeze(-1), 1)


# --- index_put (buf[idx] = v) under forward-mode AD ----------------------------------------------------------------

_INDEX_PUT_EVIDENCE = (
    "where indices repeat and accumulate is False, aten::index_put's forward-AD formula writes the tangent of one of "
    "the repeated positions (the one whose value wins) while its backward gives every one of them the gradient: "
    "jacfwd and hessian disagree with jacrev and the per-sample loop of torch.autograd (measured: out[idx] += v into "
    "zeros, max abs diff 1.2 under jacfwd and 0.7 under hessian)")
define_op("index_put", "", tensors=("self", "values"), doc="self with values written (or added) at indices",
          opinfo=("index_put",), overloads=overloads("index_put", only=("index_put",)),
          rules={"native": rules.fails_when(lambda ctx: "jvp" in ctx.stack, "mismatch", _INDEX_PUT_EVIDENCE)})
# buf[idx] = v (index_put_) batches natively: routed only under forward-mode AD, through index_put.
inplace_under_jvp.declare("index_put_", "index_put")


def _repeats(self: torch.Tensor, indices: list[torch.Tensor | None]) -> bool:
    """Whether, in any sample of any vmap level, two of the positions ``indices`` writes are the same."""
    positions = torch.arange(self.numel(), device=self.device).view(self.shape)
    written = positions[tuple(slice(None) if index is None else index for index in indices)].reshape(-1)
    if written.shape[0] < 2:
        return False
    ordered = written.sort().values
    return bool(every_sample((ordered[1:] == ordered[:-1]).any()).any())


@register("index_put", "functional")
def index_put_functional(self, indices, values, accumulate=False):
    """PyTorch's own index_put; where indices repeat without accumulate, its value with the derivative its backward
    has (every repeated position's values get the gradient): masked self, plus the written values, plus the
    accumulated values' derivative (a zero whose tangent is theirs), so that forward and reverse mode agree."""
    if accumulate or not (self.is_floating_point() or self.is_complex()) or not _repeats(self, indices):
        return aten.index_put.default(self, indices, values, accumulate)
    values = values.to(self.dtype)
    zero = torch.zeros((), dtype=self.dtype, device=self.device)
    masked = aten.index_put.default(self, indices, zero, False)
    written = aten.index_put.default(torch.zeros_like(self), indices, values, False).detach()
    summed = aten.index_put.default(torch.zeros_like(self), indices, values, True)
    plain = summed.detach()
    derivative = torch.where(plain.isfinite(), summed - plain, zero)  # inf - inf would be nan
    return masked + written + derivative
