"""Composites of the scatter-reduction family: ``index_reduce``, ``scatter_reduce``, ``segment_reduce``, and
``scatter_add`` with a row index (a graph library's ``scatter(..., reduce="sum")``) as the rows op of our own under
vmap(grad).

All of them are written as ``scatter_reduce`` with ``include_self`` (which has a batching rule) over an index of
``src``'s shape, so a batched index is just one more dimension. The product is the exception: PyTorch's backward of
``scatter_reduce(..., "prod")`` asks ``.item()`` whether two zeros meet in one slot (to refuse a double backward), which
raises under vmap; ``scatter_prod`` computes the product without that backward.
"""

from __future__ import annotations

import math

import torch

from composites.checks import check_dim
from composites.index import rows_under_per_sample_gradients
from composites.our_ops import OPS as CPP_OPS
from registry.core import rules
from registry.core.cost import batch_and_numel
from registry.core.registration import define_op, register

aten = torch.ops.aten

_PROD_ITEM = ("the backward of the 'prod' reduction calls .item() (to refuse a double backward when two zeros meet "
              "in one slot), which vmap rejects")


_vmap_of_grad = rules.under_vmap_with("grad")


define_op(
    "index_reduce", "", tensors=("self", "index", "source"),
    doc="self with source's slices reduced (prod, mean, amax, amin) into the slices index names along dim",
    opinfo=("index_reduce.prod", "index_reduce.mean", "index_reduce.amax", "index_reduce.amin"), inplace=False,
    # The rules cannot see `reduce`: under vmap(grad) the worst measured, prod's .item() error, stands for all.
    rules={"native": rules.first_of(
        rules.fails_when(_vmap_of_grad, "error", "aten::index_reduce has no batching rule (vmap runs a per-sample "
                                                 f"loop), and for prod {_PROD_ITEM}"),
        rules.no_batching_rule("aten::index_reduce"))},
    sizes=batch_and_numel,  # NOTE: vmap's loop beats the composite over a few small samples: by cost
)

# NOTE [rows ops] in registry/core/kernels/rows.cpp: graph libraries sum messages with scatter_add over an index
# expanded from one row index (``index.view(-1, 1).expand_as(src)``); under vmap(grad) functorch's rule scatters with
# the batched index and the backward gathers with it, an expanded index over every element.
define_op(
    "scatter_add", "", tensors=("self", "index", "src"),
    doc="self with src summed into the positions index names along dim", opinfo=("scatter_add",),
    preference=rows_under_per_sample_gradients("scatter_add"),
)


@register("scatter_add", "cpp_op", redirect="multicomposite::scatter_add.entry")
def scatter_add_cpp_op(self, dim, index, src):
    """Along the first dimension with an index that repeats one row index along the others: multicomposite::add_rows
    (self plus src's rows summed at that row index), whose src's gradient is multicomposite::gather_rows (rows.cpp);
    any other index: PyTorch's own scatter_add (multicomposite::scatter_add.entry decides in C++)."""
    return CPP_OPS.get().scatter_add.entry(self, dim, index, src)


define_op(
    "scatter_reduce", "two", tensors=("self", "index", "src"),
    doc="self with src reduced (sum, prod, mean, amax, amin) into the positions index names along dim",
    opinfo=("scatter_reduce.prod", "scatter_reduce.sum", "scatter_reduce.mean", "scatter_reduce.amax",
            "scatter_reduce.amin"), inplace=False,
    # The rule cannot see `reduce`: under vmap(grad) it sends every reduction to the functional composite, which
    # for all but prod is PyTorch's own scatter_reduce.
    rules={"native": rules.fails_when(_vmap_of_grad, "error", _PROD_ITEM)},
)


def scatter_prod(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                 include_self: bool) -> torch.Tensor:
    """``self.scatter_reduce(dim, index, src, "prod", include_self=include_self)`` with derivatives of every order
    made of ops that batch (no ``.item()``).

    The product of a slot's nonzero factors is PyTorch's own value ``P0`` (computed without autograd), carried as
    ``P0 * exp(L - L0)`` where ``L`` is the sum of the log-magnitudes: equal to ``P0`` in value, and its derivatives
    are those of the product (``P / x`` and on). A slot with exactly one zero factor is that product times the sum of
    its zero factors (value 0, derivative the product of the others); with two or more zeros the slot is 0 and so
    is its first derivative.
    """
    zero = torch.zeros((), dtype=self.dtype, device=self.device)
    one = torch.ones((), dtype=self.dtype, device=self.device)
    src_zero = src == 0
    self_zero = (self == 0) if include_self else torch.zeros_like(self, dtype=torch.bool)
    masked_src = torch.where(src_zero, one, src)
    masked_self = torch.where(self_zero, one, self)
    with torch.no_grad():
        product = aten.scatter_reduce.two(masked_self.detach(), dim, index, masked_src.detach(), "prod",
                                          include_self=include_self)
    self_log = masked_self.abs().log() if include_self else torch.zeros_like(self)
    logs = self_log.scatter_add(dim, index, masked_src.abs().log())
    nonzero_product = product * torch.exp(logs - logs.detach())
    zeros = self_zero.to(self.dtype).scatter_add(dim, index, src_zero.to(self.dtype))
    zero_sum = torch.where(self_zero, self, zero).scatter_add(dim, index, torch.where(src_zero, src, zero))
    reduced = torch.where(zeros == 0, nonzero_product, torch.where(zeros == 1, nonzero_product * zero_sum, zero))
    reached = torch.zeros_like(self, dtype=torch.bool).scatter(dim, index, torch.ones_like(src, dtype=torch.bool))
    return torch.where(reached, reduced, self)


def _scatter_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, reduce: str,
                    include_self: bool) -> torch.Tensor:
    if reduce == "prod":
        return scatter_prod(self, dim, index, src, include_self)
    return aten.scatter_reduce.two(self, dim, index, src, reduce, include_self=include_self)


@register("scatter_reduce", "functional")
def scatter_reduce_functional(self, dim, index, src, reduce, *, include_self=True):
    """PyTorch's scatter_reduce, the product computed without its .item() backward (see scatter_prod)."""
    if self.dim() == 0:
        out = _scatter_reduce(self.reshape(1), 0, index.reshape(1), src.reshape(1), reduce, include_self)
        return out.reshape(())
    return _scatter_reduce(self, dim, index, src, reduce, include_self)


@register("index_reduce", "functional")
def index_reduce_functional(self, dim, index, source, reduce, *, include_self=True):
    """scatter_reduce over index expanded to source's shape along dim (the product without .item())."""
    if reduce not in ("prod", "mean", "amax", "amin"):
        # PyTorch's own check, so that the error is the same
        return aten.index_reduce(self, dim, index, source, reduce, include_self=include_self)
    check_dim(self, dim)
    if self.dim() == 0:
        self_1d, source_1d = self.reshape(1), source.reshape(1)
        out = _scatter_reduce(self_1d, 0, index.reshape(1), source_1d, reduce, include_self)
        return out.reshape(())
    dim = dim % self.dim()
    source = source.reshape([1] * self.dim()) if source.dim() == 0 else source
    shape = [1] * source.dim()
    shape[dim] = -1
    expanded = index.reshape(shape).expand_as(source)
    return _scatter_reduce(self, dim, expanded, source, reduce, include_self)


define_op(
    "segment_reduce", "", tensors=("data", "lengths", "indices", "offsets"),
    doc="data reduced (sum, mean, prod, max, min) over consecutive segments of axis given by lengths or offsets",
    opinfo=("_segment_reduce.lengths", "_segment_reduce.offsets"), inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::segment_reduce"),
                                    rules.backward_without_batching_rule("aten::_segment_reduce_backward"))},
    sizes=batch_and_numel,  # NOTE: vmap's loop beats the composite over a few small samples: by cost
)


def _segment_ids(lengths: torch.Tensor | None, offsets: torch.Tensor | None, size: int,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """Each position along the reduced axis -> its segment (shape ``lengths.shape[:-1] + (size,)``), and the number
    of segments; positions outside every segment go to one extra segment, dropped afterwards."""
    positions = torch.arange(size, device=device)
    if lengths is not None:
        ends = torch.cumsum(lengths, -1)
        count = lengths.shape[-1]
        outside = positions >= ends[..., -1:]
    else:
        ends = offsets[..., 1:]
        count = offsets.shape[-1] - 1
        outside = (positions < offsets[..., :1]) | (positions >= offsets[..., -1:])
    ids = (ends.unsqueeze(-1) <= positions).sum(-2)
    return torch.where(outside, count, ids), count


@register("segment_reduce", "functional")
def segment_reduce_functional(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                              initial=None):
    """scatter_add / scatter_reduce over each position's segment id (from lengths or offsets compared with arange)."""
    if indices is not None or (lengths is None and offsets is None) or reduce not in _SEGMENT_REDUCTIONS:
        # PyTorch's own checks, so that the error is the same
        return aten.segment_reduce(data, reduce, lengths=lengths, indices=indices, offsets=offsets, axis=axis,
                                   unsafe=unsafe, initial=initial)
    axis = axis % data.dim()
    ids, count = _segment_ids(lengths, offsets, data.shape[axis], data.device)
    index = ids.reshape(*ids.shape, *([1] * (data.dim() - axis - 1))).expand(data.shape)
    shape = list(data.shape)
    shape[axis] = count + 1  # the extra segment collects positions outside every segment
    out = _SEGMENT_REDUCTIONS[reduce](data, axis, index, shape, initial)
    return out.narrow(axis, 0, count)


def _full(data: torch.Tensor, shape: list[int], value: float) -> torch.Tensor:
    return torch.full(shape, value, dtype=data.dtype, device=data.device)


def _segment_sum(data: torch.Tensor, axis: int, index: torch.Tensor, shape: list[int], initial) -> torch.Tensor:
    return _full(data, shape, 0 if initial is None else initial).scatter_add(axis, index, data)


def _segment_mean(data: torch.Tensor, axis: int, index: torch.Tensor, shape: list[int], initial) -> torch.Tensor:
    """(initial + sum) / count, as PyTorch computes it (initial is not counted); an empty segment is initial, or nan."""
    total = _full(data, shape, 0 if initial is None else initial).scatter_add(axis, index, data)
    count = _full(data, shape, 0).scatter_add(axis, index, torch.ones_like(data))
    empty = count == 0
    mean = total / torch.where(empty, 1, count)  # never 0 / 0 in a branch `where` drops: its gradient would be nan
    return torch.where(empty, math.nan if initial is None else initial, mean)


def _segment_extreme(reduce: str):
    """max / min: the extreme of the data (its gradient split among the data that tie, as PyTorch's), or initial
    where initial is beyond it (then the data get no gradient); an empty segment is initial, or -inf / inf."""
    bound = -math.inf if reduce == "amax" else math.inf

    def extreme(data: torch.Tensor, axis: int, index: torch.Tensor, shape: list[int], initial) -> torch.Tensor:
        found = _full(data, shape, bound).scatter_reduce(axis, index, data, reduce, include_self=False)
        if initial is None:
            return found
        beyond = (found < initial) if reduce == "amax" else (found > initial)
        return torch.where(beyond, initial, found)

    return extreme


def _segment_prod(data: torch.Tensor, axis: int, index: torch.Tensor, shape: list[int], initial) -> torch.Tensor:
    return scatter_prod(_full(data, shape, 1 if initial is None else initial), axis, index, data, True)


_SEGMENT_REDUCTIONS = {"sum": _segment_sum, "mean": _segment_mean, "max": _segment_extreme("amax"),
                       "min": _segment_extreme("amin"), "prod": _segment_prod}
