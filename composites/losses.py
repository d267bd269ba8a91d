"""Composites of the loss family: losses and distances whose PyTorch kernels have no batching rule.

Each composite is the loss's formula, as ATen writes it, in ops that batch and differentiate (elementwise ops,
``gather``, reductions, ``einsum``): under vmap they run once on the whole batch instead of vmap's per-sample loop,
and their derivatives are those ops' own. Where ATen keeps a strict comparison (``if (z > 0)`` in the margin losses'
kernels) the composite does too, so that gradients agree at the hinge's corner. ``reduction`` is ATen's enum:
0 none, 1 mean, 2 sum.
"""

from __future__ import annotations

import math

import torch

from registry.core import rules
from registry.core.context import Context, vmap_levels
from registry.core.registration import define_op, register, register_derivative

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
def _scores_sizes(ctx: Context) -> dict[str, int] | None:
    """The samples, each sample's rows and classes of a (C,) or (N, C) scores tensor (the first argument)."""
    if not ctx.shapes or len(ctx.shapes[0]) not in (1, 2):
        return None
    scores = ctx.shapes[0]
    return {"batch": ctx.batch_size, "rows": scores[0] if len(scores) == 2 else 1, "classes": scores[-1]}


def _multi_margin_sizes(ctx: Context) -> dict[str, int] | None:
    """What vmap's loop over PyTorch's kernel (one call per sample) and the composite's dozen batched ops cost
    (``_scores_sizes``); None where the class weights are batched (not measured)."""
    return None if "weight" in ctx.batched else _scores_sizes(ctx)


define_op(
    "multi_margin_loss", "", tensors=("self", "target", "weight"),
    doc="multi-class hinge loss of the scores self against the class indices target, reduced",
    opinfo=("nn.functional.multi_margin_loss",), inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::multi_margin_loss"),
                                    rules.backward_without_batching_rule("aten::multi_margin_loss_backward"))},
    # NOTE: the composite's dozen batched ops cost more than vmap's loop over a few samples (0.5x-0.8x native at
    # batch 4-16, 1.2x-1.5x at 64, measured): chosen by cost.
    sizes=_multi_margin_sizes,
)
def _multilabel_margin_sizes(ctx: Context) -> dict[str, int] | None:
    """What vmap's loop over PyTorch's kernel and the composite's (rows, labels, classes) comparisons cost
    (``_scores_sizes``); None unless the scores and the label lists are batched (measured so)."""
    return _scores_sizes(ctx) if set(ctx.batched) == {"self", "target"} else None


define_op(
    "multilabel_margin_loss", "", tensors=("self", "target"),
    doc="multi-label hinge loss of the scores self against the -1-terminated class lists target, reduced",
    opinfo=("nn.functional.multilabel_margin_loss",), inplace=False,
    rules={"native": rules.first_of(
        rules.no_batching_rule("aten::multilabel_margin_loss_forward"),
        rules.backward_without_batching_rule("aten::multilabel_margin_loss_backward"))},
    # NOTE: the composite's comparisons cost more than vmap's loop over a few samples (0.5x-0.8x native at batch
    # 4-16 on OpInfo's samples, measured): chosen by cost.
    sizes=_multilabel_margin_sizes,
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
def _pdist_sizes(ctx: Context) -> dict[str, int] | None:
    """What vmap's loop over _pdist_forward and the composite's pairs cost: the samples, each sample's rows (the
    pairs grow with their square) and features."""
    if not ctx.shapes or len(ctx.shapes[0]) != 2:
        return None
    rows, features = ctx.shapes[0]
    return {"batch": ctx.batch_size, "rows": rows, "features": features}


define_op(
    "pdist", "", tensors=("self",), doc="p-norm distances between the rows of self, upper triangle, row by row",
    opinfo=("nn.functional.pdist",), inplace=False,
    rules={"native": rules.first_of(
        # The errors first: where native raises, its loop under vmap is not a choice (selection by cost weighs
        # native only where it is correct and only loops).
        rules.no_forward_ad("aten::_pdist_forward"),
        rules.no_second_derivative("aten::_pdist_backward"),
        rules.no_batching_rule("aten::_pdist_forward"),
        rules.backward_without_batching_rule("aten::_pdist_backward", status="error"))},
    # NOTE: vmap's loop over PyTorch's kernel beats the composite's index_select pairs where a sample has many rows
    # (0.6x native under vmap(grad) at 100 rows, 2.5x at 10 rows and batch 256, measured): chosen by cost.
    sizes=_pdist_sizes,
)
def _bilinear_sizes(ctx: Context) -> dict[str, int] | None:
    """What vmap's loop over PyTorch's kernel and the composite's einsum cost: the samples, each sample's rows, the
    input features and the output features; None where the weight is batched (an ensemble: not measured)."""
    if len(ctx.shapes) < 3 or not ctx.shapes[0] or len(ctx.shapes[2]) != 3 or "weight" in ctx.batched:
        return None
    rows = math.prod(ctx.shapes[0][:-1])
    return {"batch": ctx.batch_size, "rows": rows, "features": ctx.shapes[0][-1], "out": ctx.shapes[2][0]}


define_op(
    "bilinear", "", tensors=("input1", "input2", "weight", "bias"),
    doc="input1^T weight[o] input2 + bias[o] for every output feature o", opinfo=("nn.functional.bilinear",),
    inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::bilinear"),
                                    rules.backward_without_batching_rule("aten::_trilinear", status="error"))},
    # NOTE: at a few samples vmap's loop over PyTorch's kernel beats the einsum (0.8x native under vmap at batch 4,
    # 2x-8x from batch 16, measured): chosen by cost.
    sizes=_bilinear_sizes,
)


# --- composites ----------------------------------------------------------------------------------------------------


@register("soft_margin_loss", "functional")
def soft_margin_loss_functional(self, target, reduction=_MEAN):
    """log1p(exp(-self * target)), reduced: ATen's formula in elementwise ops.

    target is detached: PyTorch's derivatives treat it as non-differentiable (its backward refuses a target that
    requires grad, its forward-AD tangent with respect to target is zero), so jacfwd over target is zero here too.
    """
    return _reduce(torch.log1p(torch.exp(-self * target.detach())), reduction)


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
    samples = self.shape[0] if self.dim() == 2 else 1
    if p not in (1, 2) or self.dim() > 2 or target.dim() > 1 or target.numel() != samples or self.numel() == 0:
        # Shapes this formula does not cover (and p other than 1 and 2): PyTorch's own kernel, which accepts what it
        # accepts (self (C,) with target (1,), self (1, C) with target ()) and raises its own error otherwise.
        return aten.multi_margin_loss(self, target, p, margin, weight, reduction)
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


# --- ctc_loss ------------------------------------------------------------------------------------------------------

def _ctc_sizes(ctx: Context) -> dict[str, int] | None:
    """What the composite's recursion costs (a step of a few ops per time step over 2 * labels + 1 states, for the
    whole batch) and vmap's loop over PyTorch's kernel (one call per sample): the samples (the vmap batch times the
    sample's own N), the time steps and the labels per sequence."""
    if len(ctx.shapes) < 2 or len(ctx.shapes[0]) not in (2, 3):
        return None
    log_probs, targets = ctx.shapes[0], ctx.shapes[1]
    per_sample = log_probs[1] if len(log_probs) == 3 else 1
    if len(targets) == 2:
        labels = targets[1]
    elif len(targets) == 1:  # concatenated (or one unbatched sequence): the mean length
        labels = targets[0] // max(per_sample, 1)
    else:
        return None
    return {"batch": ctx.batch_size * per_sample, "steps": log_probs[0], "labels": labels}


define_op(
    "ctc_loss", "IntList", tensors=("log_probs", "targets"),
    doc="connectionist temporal classification loss of the label sequences targets given log_probs (T, N, C)",
    opinfo=("nn.functional.ctc_loss",), inplace=False,
    rules={"native": rules.first_of(rules.no_forward_ad("aten::_ctc_loss"),
                                    rules.no_second_derivative("aten::_ctc_loss_backward"),
                                    rules.no_batching_rule("aten::_ctc_loss"),
                                    rules.backward_without_batching_rule("aten::_ctc_loss_backward"))},
    # NOTE: the composite's Python loop over time costs a dozen batched ops a step: vmap's loop over PyTorch's
    # kernel was 3x-40x faster at batch 4-64 (measured), so native runs wherever it is correct unless the costs say.
    sizes=_ctc_sizes,
)


def _logsumexp(*terms: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(terms))) elementwise, -inf where every term is -inf, with a finite gradient everywhere (the
    shift is detached, and where the sum is 0 the log's branch is never selected)."""
    stacked = torch.stack(terms)
    shift = stacked.amax(0).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    total = torch.exp(stacked - shift).sum(0)
    positive = total > 0
    return torch.where(positive, shift + torch.log(torch.where(positive, total, torch.ones_like(total))),
                       torch.full_like(total, -math.inf))


def _lengths(lengths: torch.Tensor | list[int], like: torch.Tensor) -> torch.Tensor:
    return lengths.to(like.device) if isinstance(lengths, torch.Tensor) else torch.tensor(lengths, device=like.device)


@register("ctc_loss", "functional")
def ctc_loss_functional(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=_MEAN,
                        zero_infinity=False):
    """The CTC forward (alpha) recursion over time in log space, all samples and states at once: a gather of the
    extended labels' log-probabilities, then per step a three-way logsumexp; samples past their input length keep
    their alphas. Lengths may be lists or (batched) tensors. The gradient is PyTorch's, which adds exp(log_probs)
    at t < input_length (it is the gradient through a log_softmax: see the comment below)."""
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
    steps, batch, _ = log_probs.shape
    input_len = _lengths(input_lengths, log_probs).reshape(batch)
    target_len = _lengths(target_lengths, log_probs).reshape(batch)
    if targets.dim() == 1:  # concatenated: sample n's labels start after the labels of samples 0..n-1
        starts = torch.cumsum(target_len, 0) - target_len
        longest = targets.shape[0]
        positions = (starts.unsqueeze(1) + torch.arange(longest, device=targets.device)).clamp_max(max(longest - 1, 0))
        padded = targets[positions] if longest > 0 else targets.new_zeros(batch, 0)
    else:
        padded = targets
    labels = padded.shape[1]
    states = 2 * labels + 1
    extended = torch.full((batch, states), blank, dtype=padded.dtype, device=padded.device)
    extended = extended.index_copy(1, torch.arange(1, states, 2, device=padded.device), padded)
    emissions = log_probs.gather(2, extended.unsqueeze(0).expand(steps, batch, states))  # (T, N, S)
    odd = torch.arange(states, device=padded.device) % 2 == 1
    skip = torch.zeros_like(extended, dtype=torch.bool)
    if states > 2:
        skip = torch.cat([skip[:, :2], (extended[:, 2:] != extended[:, :-2]) & odd[2:]], dim=1)
    minus_inf = torch.full_like(emissions[0], -math.inf)
    alpha = torch.cat([emissions[0, :, :2], minus_inf[:, 2:]], dim=1) if states > 1 else emissions[0]
    for t in range(1, steps):
        from_previous = torch.cat([minus_inf[:, :1], alpha[:, :-1]], dim=1)
        from_skip = torch.where(skip, torch.cat([minus_inf[:, :2], alpha[:, :-2]], dim=1), minus_inf)
        advanced = _logsumexp(alpha, from_previous, from_skip) + emissions[t]
        alpha = torch.where((t < input_len).unsqueeze(1), advanced, alpha)
    last = (2 * target_len).unsqueeze(1)
    final = alpha.gather(1, last).squeeze(1)
    before_last = torch.where(target_len > 0, alpha.gather(1, (last - 1).clamp_min(0)).squeeze(1),
                              torch.full_like(final, -math.inf))
    nll = -_logsumexp(final, before_last)
    # PyTorch's _ctc_loss_backward returns exp(log_probs) - exp(log_alpha_beta + nll - log_probs) at t <
    # input_length: the true gradient plus exp(log_probs), which is the gradient with respect to the logits once it
    # goes through log_softmax. The composite adds a term whose value is exactly 0 and whose gradient is that
    # exp(log_probs), so that its derivatives equal PyTorch's.
    probabilities = torch.exp(log_probs)
    within = (torch.arange(steps, device=log_probs.device).unsqueeze(1) < input_len).unsqueeze(2)  # (T, N, 1)
    nll = nll + ((probabilities - probabilities.detach()) * within).sum((0, 2))
    if zero_infinity:
        nll = torch.where(torch.isinf(nll.detach()), torch.zeros_like(nll), nll)
    if reduction == _MEAN:
        return (nll / target_len.clamp_min(1).to(nll.dtype)).mean()
    if unbatched and reduction == _NONE:
        return nll.squeeze(0)
    return _reduce(nll, reduction)


# --- cdist ---------------------------------------------------------------------------------------------------------

# Measured on torch 2.13: jacrev of cdist (every p but 2 on the matrix-product path) is wrong, silently: jacrev vmaps
# cdist's backward over the cotangent alone, and _cdist_backward's batching rule gives wrong values where grad is
# batched and x1, x2 and cdist are not (nan where grad and x1 are and cdist is not); with all four batched it is right.
# Inside use() the derivative kernel below batches all four alike, so native keeps no rule.
define_op("cdist", "", tensors=("x1", "x2"), doc="the p-norm distance between every row of x1 and every row of x2",
          opinfo=("cdist",), inplace=False)


@register("cdist", "functional")
def cdist_functional(x1, x2, p=2.0, compute_mode=None):
    """vector_norm of every difference of a row of x1 and a row of x2 (it batches and differentiates)."""
    if x1.dim() < 2 or x2.dim() < 2:
        raise RuntimeError(f"cdist only supports at least 2D tensors, X1 got: {x1.dim()}D")
    if x1.shape[-1] != x2.shape[-1]:
        raise RuntimeError(f"X1 and X2 must have the same number of columns. X1: {x1.shape[-1]} X2: {x2.shape[-1]}")
    if p < 0:
        raise RuntimeError("cdist only supports non-negative p values")
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), ord=p, dim=-1)


@register_derivative("cdist", "_cdist_backward")
def cdist_backward_functional(grad, x1, x2, p, cdist):
    """PyTorch's own kernel with its four tensors batched alike (a zero that is batched wherever one of them is,
    added to each): the case its batching rule gets right. Empty tensors have no values to get wrong."""
    tensors = (grad, x1, x2, cdist)
    # NOTE: under vmap(grad) with both inputs per sample all four are batched at every level already; the zeros
    # there cost five reductions and four adds a call, which made use() 0.5x native on small cdists (measured).
    if any(t.numel() == 0 for t in tensors) or len({vmap_levels(t) for t in tensors}) == 1:
        return aten._cdist_backward(grad, x1, x2, p, cdist)
    zero = sum(torch.zeros_like(t).sum() for t in (grad, x1, x2, cdist))
    return aten._cdist_backward(grad + zero, x1 + zero, x2 + zero, p, cdist + zero)
