"""Composites of the loss family: losses and distances whose PyTorch kernels have no batching rule.

Each composite is the loss's formula, as ATen writes it, in ops that batch and differentiate (elementwise ops,
``gather``, reductions, ``einsum``): under vmap they run once on the whole batch instead of vmap's per-sample loop,
and their derivatives are those ops' own. Where ATen keeps a strict comparison (``if (z > 0)`` in the margin losses'
kernels) the composite does too, so that gradients agree at the hinge's corner. ``reduction`` is ATen's enum:
0 none, 1 mean, 2 sum.
"""

from __future__ import annotations

import torch

from registry.core import rules
from registry.core.context import Context
from registry.core.registration import define_op, register

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss: torch.Tensor, reduction: int) -> torch.Tensor:
    """ATen's apply_loss_reduction."""
    if reduction == _MEAN:
        return loss.mean()
    if reduction == _SUM:
        return loss.sum()
    if reduction == _NONE:
        return loss
    raise ValueError(f"reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction!r}")


def _innermost_vmap(ctx: Context) -> bool:
    """The innermost transform is vmap: a CompositeImplicitAutograd op that functorch does not decompose meets vmap's
    per-sample fallback there; under an inner grad or jvp it is decomposed first, into ops that batch."""
    return ctx.stack[-1:] == ("vmap",) or "compile" in ctx.stack


def _decomposed_without_batching_rule(aten_name: str) -> rules.Rule:
    return rules.fails_when(
        _innermost_vmap, "slow",
        f"{aten_name} has no batching rule and functorch does not decompose it, so plain vmap runs a per-sample loop "
        "(under vmap(grad) and vmap(jvp) autograd decomposes it first, into ops that batch)")


# --- the ops -------------------------------------------------------------------------------------------------------

define_op(
    "soft_margin_loss", "", tensors=("self", "target"), doc="log(1 + exp(-target * self)), reduced",
    opinfo=("nn.functional.soft_margin_loss",), inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::soft_margin_loss"),
                                    rules.backward_without_batching_rule("aten::soft_margin_loss_backward"))},
)
define_op(
    "margin_ranking_loss", "", tensors=("input1", "input2", "target"),
    doc="max(0, -target * (input1 - input2) + margin), reduced", opinfo=("nn.functional.margin_ranking_loss",),
    inplace=False, rules={"native": _decomposed_without_batching_rule("aten::margin_ranking_loss")},
)
define_op(
    "multi_margin_loss", "", tensors=("self", "target", "weight"),
    doc="multi-class hinge loss of the scores self against the class indices target, reduced",
    opinfo=("nn.functional.multi_margin_loss",), inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::multi_margin_loss"),
                                    rules.backward_without_batching_rule("aten::multi_margin_loss_backward"))},
)
define_op(
    "multilabel_margin_loss", "", tensors=("self", "target"),
    doc="multi-label hinge loss of the scores self against the -1-terminated class lists target, reduced",
    opinfo=("nn.functional.multilabel_margin_loss",), inplace=False,
    rules={"native": rules.first_of(
        rules.no_batching_rule("aten::multilabel_margin_loss_forward"),
        rules.backward_without_batching_rule("aten::multilabel_margin_loss_backward"))},
)
define_op(
    "triplet_margin_loss", "", tensors=("anchor", "positive", "negative"),
    doc="max(0, margin + d(anchor, positive) - d(anchor, negative)), reduced",
    opinfo=("nn.functional.triplet_margin_loss",), inplace=False,
    rules={"native": _decomposed_without_batching_rule("aten::triplet_margin_loss")},
)
define_op(
    "kl_div", "", tensors=("self", "target"), doc="pointwise KL divergence of target from the log-probabilities self",
    opinfo=("nn.functional.kl_div",), inplace=False,
    rules={"native": _decomposed_without_batching_rule("aten::kl_div")},
)
define_op(
    "pdist", "", tensors=("self",), doc="p-norm distances between the rows of self, upper triangle, row by row",
    opinfo=("nn.functional.pdist",), inplace=False,
    rules={"native": rules.first_of(
        rules.no_batching_rule("aten::_pdist_forward"),
        rules.backward_without_batching_rule("aten::_pdist_backward", status="error"))},
)
define_op(
    "bilinear", "", tensors=("input1", "input2", "weight", "bias"),
    doc="input1^T weight[o] input2 + bias[o] for every output feature o", opinfo=("nn.functional.bilinear",),
    inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::bilinear"),
                                    rules.backward_without_batching_rule("aten::_trilinear", status="error"))},
)


# --- composites ----------------------------------------------------------------------------------------------------


@register("soft_margin_loss", "functional")
def soft_margin_loss_functional(self, target, reduction=_MEAN):
    """log1p(exp(-self * target)), reduced: ATen's formula in elementwise ops."""
    return _reduce(torch.log1p(torch.exp(-self * target)), reduction)


@register("margin_ranking_loss", "functional")
def margin_ranking_loss_functional(input1, input2, target, margin=0.0, reduction=_MEAN):
    """clamp_min(-target * (input1 - input2) + margin, 0), reduced: ATen's formula in elementwise ops."""
    # add.Scalar as ATen's C++ does: Python's ``+ margin`` makes margin a wrapped-number tensor, and under vmap(jvp)
    # a 0-d tensor plus a wrapped number gets a float64 tangent (measured, torch 2.13).
    return _reduce(aten.add.Scalar(-target * (input1 - input2), margin).clamp_min(0), reduction)


def _hinge(z: torch.Tensor) -> torch.Tensor:
    """z where z > 0, else 0: the margin kernels' ``if (z > 0)``, whose gradient is 0 at z == 0."""
    return torch.where(z > 0, z, torch.zeros_like(z))


@register("multi_margin_loss", "functional")
def multi_margin_loss_functional(self, target, p=1, margin=1, weight=None, reduction=_MEAN):
    """sum over classes i != target of max(0, margin - self[target] + self[i])^p (times weight[target]) / C, with
    the target's score gathered: one batched gather instead of the kernel's loop over samples."""
    if p not in (1, 2):
        raise ValueError(f"multi_margin_loss: only p == 1 and p == 2 are supported, got p={p}")
    if self.dim() > 2 or target.dim() != max(self.dim() - 1, 0):
        raise ValueError(f"multi_margin_loss: expected self of shape (N, C) or (C,) and target of shape (N,) or (), "
                         f"got {tuple(self.shape)} and {tuple(target.shape)}")
    classes = self.shape[-1] if self.dim() > 0 else 1
    scores = self.reshape(-1, classes)
    labels = target.reshape(-1, 1)
    z = _hinge(margin - scores.gather(1, labels) + scores)
    if p == 2:
        z = z * z
    if weight is not None:
        z = z * weight[labels]
    others = torch.arange(classes, device=self.device) != labels  # the target's own term is left out
    loss = (z * others).sum(1) / classes
    return _reduce(loss.reshape(target.shape), reduction)


@register("multilabel_margin_loss", "functional")
def multilabel_margin_loss_functional(self, target, reduction=_MEAN):
    """sum over target labels j and non-target classes i of max(0, 1 - (self[j] - self[i])) / C; the labels are
    target's entries up to its first -1, found with a cumulative product instead of the kernel's loop."""
    if self.dim() > 2 or target.shape != self.shape:
        raise ValueError(f"multilabel_margin_loss: expected self of shape (N, C), (C,) or () and target of the same "
                         f"shape, got {tuple(self.shape)} and {tuple(target.shape)}")
    classes = self.shape[-1] if self.dim() > 0 else 1
    scores = self.reshape(-1, classes)
    labels = target.reshape(-1, classes)
    listed = torch.cumprod((labels >= 0).to(torch.int64), dim=1).bool()  # (N, C_j): j before the first -1
    safe = labels.clamp_min(0)
    one_hot = (safe.unsqueeze(2) == torch.arange(classes, device=self.device)) & listed.unsqueeze(2)  # (N, j, i)
    is_target = one_hot.any(1)  # (N, i)
    z = _hinge(1 - scores.gather(1, safe).unsqueeze(2) + scores.unsqueeze(1))  # (N, j, i)
    counted = listed.unsqueeze(2) & ~is_target.unsqueeze(1)
    loss = (z * counted).sum((1, 2)) / classes
    return _reduce(loss.reshape(target.shape[:-1] if target.dim() > 0 else ()), reduction)


def _pairwise_distance(x1: torch.Tensor, x2: torch.Tensor, p: float, eps: float) -> torch.Tensor:
    """ATen's pairwise_distance: norm(x1 - x2 + eps, p) over the last dimension of the broadcast inputs."""
    dim = max(x1.dim(), x2.dim()) - 1
    return torch.linalg.vector_norm(x1 - x2 + eps, p, dim=dim if dim >= 0 else None)


@register("triplet_margin_loss", "functional")
def triplet_margin_loss_functional(anchor, positive, negative, margin=1.0, p=2.0, eps=1e-06, swap=False,
                                   reduction=_MEAN):
    """clamp_min(margin + d(anchor, positive) - d(anchor, negative), 0), reduced, with d ATen's pairwise distance
    (and d(anchor, negative) replaced by min(d(anchor, negative), d(positive, negative)) with swap)."""
    if not anchor.dim() == positive.dim() == negative.dim():
        raise ValueError(f"triplet_margin_loss: anchor, positive and negative must have the same number of "
                         f"dimensions, got {anchor.dim()}, {positive.dim()} and {negative.dim()}")
    distance_positive = _pairwise_distance(anchor, positive, p, eps)
    distance_negative = _pairwise_distance(anchor, negative, p, eps)
    if swap:
        distance_negative = torch.minimum(distance_negative, _pairwise_distance(positive, negative, p, eps))
    return _reduce((margin + distance_positive - distance_negative).clamp_min(0), reduction)


@register("kl_div", "functional")
def kl_div_functional(self, target, reduction=_MEAN, *, log_target=False):
    """exp(target) * (target - self) with log_target, else xlogy(target, target) - target * self; reduced."""
    if log_target:
        loss = torch.exp(target) * (target - self)
    else:
        loss = torch.xlogy(target, target) - target * self
    return _reduce(loss, reduction)


@register("pdist", "functional")
def pdist_functional(self, p=2.0):
    """The p-norm of self[i] - self[j] for the pairs i < j in row-major order: two index_selects by triu_indices
    and a vector norm, which batch and differentiate (PyTorch's _pdist_forward and _pdist_backward do neither)."""
    if self.dim() != 2:
        raise ValueError(f"pdist: only supports 2D tensors, got {self.dim()}D")
    if p < 0:
        raise ValueError(f"pdist: only supports non-negative p values, got {p}")
    rows = self.shape[0]
    first, second = torch.triu_indices(rows, rows, 1, device=self.device)
    return torch.linalg.vector_norm(self.index_select(0, first) - self.index_select(0, second), p, dim=-1)


@register("bilinear", "functional")
def bilinear_functional(input1, input2, weight, bias=None):
    """einsum('...i,oij,...j->...o') plus bias: einsum batches and differentiates, PyTorch's _trilinear does not."""
    out = torch.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias
