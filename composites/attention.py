"""Composites of the attention family: ``scaled_dot_product_attention``, and the functional forms under vmap of the
CPU fused kernel's two overloads, ``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``.

Natively, on CPU, ``F.scaled_dot_product_attention`` runs PyTorch's fused (flash) kernel for 4-d inputs without
dropout, and a math formulation otherwise. The fused kernel and its backward have no batching rule: under vmap a
model whose attention sees 4-d samples (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, a transformer
library's attention) runs vmap's per-sample loop, forward and backward; its forward AD is not implemented (jacfwd
raises) and neither is the derivative of its backward (hessian, grad of grad raise).

- ``functional``: matmul, a masked ``_safe_softmax`` (a fully masked row gives zeros, as natively), dropout, matmul,
  as PyTorch's own math formulation; every op batches, differentiates and has forward AD.
- ``primitive``: ``FusedAttention``, PyTorch's fused CPU kernel called once for the whole batch, the vmap dimension
  folded into the kernel's batch dimension, forward and backward (``FusedAttentionBackward``, folded the same way);
  its jvp is the math formulation's, from the saved output and log-sum-exp. The kernel has no dropout and needs one
  head size for query, key and value: there the primitive composite runs the functional body.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd import Function

from registry.core import rules
from registry.core.primitive import apply, batch_first
from registry.core.registration import define_op, register, register_derivative

aten = torch.ops.aten

# dtypes PyTorch's fused CPU kernel runs; others take the functional body.
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _fused_first(ctx: rules.Context) -> rules.Order | None:
    """Under vmap the fused primitive before the functional composite: measured faster under vmap, vmap(grad) and
    vmap(jvp) (``python -m bench.attention --cpu-time``, docs/attention.md); where the primitive is invalid
    (second derivatives, functionalize, torch.compile) the functional composite is next."""
    if rules.under_vmap(ctx):
        return rules.Order(("native", "primitive", "functional", "mutating"),
                           "PyTorch's fused kernel once over the folded batch measured faster than the math "
                           "composite under vmap, vmap(grad) and vmap(jvp)")
    return None


def _attention_sizes(ctx: rules.Context) -> dict[str, int | bool] | None:
    """What the fused kernel's cost and the fold's depend on: the samples folded into one call (the vmap batch times
    the sample's own leading dimensions), heads, query length, head size, a mask or not, and the sample's rank (4-d
    samples reach the fused kernel natively; fewer dimensions take the math path, which batches)."""
    if not ctx.shapes or len(ctx.shapes[0]) < 2:
        return None
    query = ctx.shapes[0]
    return {"batch": ctx.batch_size * math.prod(query[:-3]), "heads": query[-3] if len(query) >= 3 else 1,
            "length": query[-2], "head_dim": query[-1], "mask": "attn_mask" in ctx.tensors, "rank": len(query)}


define_op(
    "scaled_dot_product_attention", "", tensors=("query", "key", "value", "attn_mask"),
    doc="softmax(query key^T * scale + mask) value over the last two dimensions, with dropout",
    opinfo=("nn.functional.scaled_dot_product_attention",), inplace=False,
    rules={
        # The errors first: where native raises, its loop under vmap is not a choice (selection by cost weighs
        # native only where it is correct and only loops).
        "native": rules.first_of(
            rules.fails_when(lambda ctx: "jvp" in ctx.stack, "error",
                             "forward AD of aten::_scaled_dot_product_flash_attention_for_cpu is not implemented "
                             "(jvp and jacfwd raise on 4-d inputs)"),
            rules.fails_when(rules.second_derivative, "error",
                             "the derivative of aten::_scaled_dot_product_flash_attention_for_cpu_backward is not "
                             "implemented (hessian and grad of grad raise on 4-d inputs)"),
            rules.no_batching_rule("aten::_scaled_dot_product_flash_attention_for_cpu",
                                   detail="vmap runs a per-sample loop over 4-d samples")),
        "primitive": rules.fails_when(rules.second_derivative, "error",
                                      "FusedAttentionBackward (PyTorch's fused backward kernel) has no derivative "
                                      "of its own: the functional composite takes second derivatives"),
    },
    preference=_fused_first,
    sizes=_attention_sizes,
)


# --- checks: native's own errors, before any kernel ----------------------------------------------------------------


def check_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    dropout_p: float, enable_gqa: bool) -> None:
    """Raise what native scaled_dot_product_attention raises for these arguments, in its words."""
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{_c_name(query.dtype)} key.dtype: {_c_name(key.dtype)} and value.dtype: "
                           f"{_c_name(value.dtype)} instead.")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError(f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
                           f"{query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype \
            and not attn_mask.dtype.is_floating_point:
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {_c_name(attn_mask.dtype)} and  query.dtype: {_c_name(query.dtype)} "
                           "instead.")
    if not 0.0 <= dropout_p <= 1.0:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if enable_gqa and query.dim() >= 3:
        heads, kv_heads = query.size(-3), key.size(-3)
        if kv_heads == 0 or heads % kv_heads != 0 or value.size(-3) != kv_heads:
            # native's words, cut short as natively
            raise RuntimeError("Number of heads in key and value must divide the number of heads in ")


def _c_name(dtype: torch.dtype) -> str:
    """A dtype as PyTorch's C++ errors name it (float, double, long int, ...)."""
    return {torch.float32: "float", torch.float64: "double", torch.int64: "long int", torch.int32: "int",
            torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.bool: "bool"}.get(
                dtype, str(dtype).removeprefix("torch."))


# --- shared pieces ---------------------------------------------------------------------------------------------------


def scale_of(query: torch.Tensor, scale: float | None) -> float:
    """The softmax scale: ``scale``, or 1/sqrt(head size) as natively."""
    return 1.0 / math.sqrt(query.size(-1)) if scale is None else scale


def additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as a bias added to the scores: a boolean mask keeps True (0) and drops False (-inf), as native's
    ``convert_boolean_attn_mask``; a float mask is added as it is."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
        return torch.where(attn_mask, zero, torch.full((), -math.inf, dtype=dtype, device=attn_mask.device))
    return attn_mask if attn_mask.dtype == dtype else attn_mask.to(dtype)


def causal_bias(length: int, source: int, like: torch.Tensor) -> torch.Tensor:
    """0 on and below the diagonal (top left aligned, as natively), -inf above it: (length, source)."""
    keep = torch.ones(length, source, dtype=torch.bool, device=like.device).tril()
    return additive_mask(keep, like.dtype)


def repeat_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads repeated to the query's ``heads`` (grouped-query attention), as natively."""
    if tensor.dim() < 3 or tensor.size(-3) == heads:
        return tensor
    return tensor.repeat_interleave(heads // tensor.size(-3), dim=-3)


# --- functional ------------------------------------------------------------------------------------------------------


@register("scaled_dot_product_attention", "functional")
def sdpa_functional(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                    enable_gqa=False):
    """matmul, masked _safe_softmax, dropout, matmul: PyTorch's math formulation, in ops that all batch."""
    check_attention(query, key, value, attn_mask, dropout_p, enable_gqa)
    if enable_gqa and query.dim() >= 3:
        key, value = repeat_heads(key, query.size(-3)), repeat_heads(value, query.size(-3))
    factor = scale_of(query, scale)
    # As natively: query and key each scaled by sqrt(|scale|) before the matmul (the sign goes with the query).
    root = math.sqrt(abs(factor))
    scores = torch.matmul(query * (-root if factor < 0 else root), key.transpose(-2, -1) * root)
    bias = additive_mask(attn_mask, query.dtype)
    if is_causal:
        causal = causal_bias(query.size(-2), key.size(-2), query)
        bias = causal if bias is None else bias + causal
    if bias is not None:
        scores = scores + bias
    weights = aten._safe_softmax(scores, -1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, dropout_p, training=True)
    return torch.matmul(weights, value)


# --- primitive: PyTorch's fused CPU kernel, the vmap dimension folded into its batch dimension -----------------------


def _as_4d(tensor: torch.Tensor) -> torch.Tensor:
    """(..., H, L, E) as the kernel's (B, H, L, E): leading dimensions flattened, missing ones added."""
    if tensor.dim() >= 4:
        return tensor.reshape(-1, *tensor.shape[-3:])
    return tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))


def _bias_4d(bias: torch.Tensor | None, lead: tuple[int, ...]) -> torch.Tensor | None:
    """A bias broadcastable to (*lead, H, L, S) as a 4-d tensor the kernel broadcasts: its own singleton head, row
    and column dimensions kept, the leading ones expanded to ``lead`` and flattened."""
    if bias is None:
        return None
    if bias.dim() < 3:
        bias = bias.reshape((1,) * (3 - bias.dim()) + tuple(bias.shape))
    rows = tuple(bias.shape[-3:])
    extra = bias.dim() - 3
    if extra > len(lead):
        raise RuntimeError(f"scaled_dot_product_attention: attn_mask of {bias.dim()} dimensions does not broadcast "
                           f"to the query's {len(lead) + 3}")
    bias = bias.reshape((1,) * (len(lead) - extra) + tuple(bias.shape))
    if all(size == 1 for size in bias.shape[:len(lead)]):
        return bias.reshape(1, *rows)
    return bias.expand(*lead, *rows).reshape(-1, *rows)


def _lead(query: torch.Tensor) -> tuple[int, ...]:
    return tuple(query.shape[:-3]) if query.dim() >= 3 else ()


def _from_4d(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The kernel's (B, H, L, E) result back in ``like``'s leading dimensions."""
    return tensor.reshape(*like.shape[:-2], *tensor.shape[-2:])


def _probabilities(query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
                   is_causal: bool, scale: float) -> torch.Tensor:
    """softmax(scale q k^T + bias) rebuilt from the kernel's log-sum-exp (a fully masked row: zeros)."""
    key = repeat_heads(key, query.size(-3)) if query.dim() >= 3 else key
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    if is_causal:
        scores = scores + causal_bias(query.size(-2), key.size(-2), query)
    return torch.exp(scores - lse.unsqueeze(-1))


def _grouped_sum(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The adjoint of ``repeat_heads``: the query heads of each key head summed back."""
    if grad.dim() < 3 or grad.size(-3) == heads:
        return grad
    groups = grad.size(-3) // heads
    return grad.reshape(*grad.shape[:-3], heads, groups, *grad.shape[-2:]).sum(-3)


class FusedAttention(Function):
    """PyTorch's fused CPU attention kernel, forward; outputs (out, logsumexp), the second non-differentiable.

    query (..., Hq, L, E), key and value (..., Hk, S, E) with the same leading dimensions (Hq a multiple of Hk);
    bias: None or a float tensor broadcastable to (..., Hq, L, S). The vmap rule moves the batch dimension to the
    front and applies the Function again, so the kernel sees it as part of its batch dimension: one call for the
    whole batch. Backward is ``FusedAttentionBackward`` (the fused backward kernel, folded the same way) and, where
    the bias needs a gradient, the math formulation's score gradient; jvp is the math formulation's.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            _as_4d(query), _as_4d(key), _as_4d(value), 0.0, is_causal, attn_mask=_bias_4d(bias, _lead(query)),
            scale=scale)
        return _from_4d(out, query), lse.reshape(query.shape[:-1])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        query, key, value, bias, ctx.is_causal, ctx.scale = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.save_for_forward(query, key, value, bias, out, lse)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
        query, key, value, bias, out, lse = ctx.saved_tensors
        grad_query, grad_key, grad_value = apply(FusedAttentionBackward, grad_out, query, key, value, bias, out,
                                                 lse, ctx.is_causal, ctx.scale)
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[3]:
            # The math formulation's: dS = P * (dO V^T - rowsum(dO * O)).
            weights = _probabilities(query, key, bias, lse, ctx.is_causal, ctx.scale)
            values = repeat_heads(value, query.size(-3)) if query.dim() >= 3 else value
            grad_weights = torch.matmul(grad_out, values.transpose(-2, -1))
            grad_scores = weights * (grad_weights - (grad_out * out).sum(-1, keepdim=True))
            grad_bias = grad_scores.sum_to_size(ctx.bias_shape)
        return grad_query, grad_key, grad_value, grad_bias, None, None

    @staticmethod
    def jvp(ctx: Any, query_t, key_t, value_t, bias_t, _is_causal_t, _scale_t):
        query, key, value, bias, _out, lse = ctx.saved_tensors
        heads = query.size(-3) if query.dim() >= 3 else None
        weights = _probabilities(query, key, bias, lse, ctx.is_causal, ctx.scale)
        keys = repeat_heads(key, heads) if heads else key
        scores_t = torch.zeros_like(weights)
        if query_t is not None:
            scores_t = scores_t + torch.matmul(query_t, keys.transpose(-2, -1)) * ctx.scale
        if key_t is not None:
            keys_t = repeat_heads(key_t, heads) if heads else key_t
            scores_t = scores_t + torch.matmul(query, keys_t.transpose(-2, -1)) * ctx.scale
        if bias_t is not None:
            scores_t = scores_t + bias_t
        weights_t = weights * (scores_t - (weights * scores_t).sum(-1, keepdim=True))
        out_t = torch.matmul(weights_t, repeat_heads(value, heads) if heads else value)
        if value_t is not None:
            out_t = out_t + torch.matmul(weights, repeat_heads(value_t, heads) if heads else value_t)
        return out_t, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], query, key, value, bias, is_causal, scale):
        rank = query.dim() - (in_dims[0] is not None)
        query, key, value, bias = batch_first(info, in_dims[:4], query, key, value, bias, rank=rank)
        return apply(FusedAttention, query, key, value, bias, is_causal, scale), (0, 0)


class FusedAttentionBackward(Function):
    """PyTorch's fused CPU attention backward kernel: (grad_query, grad_key, grad_value), the vmap dimension folded
    into the kernel's batch dimension as in ``FusedAttention``. It has no derivative of its own (the rules send
    second derivatives to the functional composite)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse_4d = lse.reshape(-1, *lse.shape[-2:]) if lse.dim() >= 2 else lse.reshape(1, 1, -1)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _as_4d(grad_out).contiguous(), _as_4d(query), _as_4d(key), _as_4d(value), _as_4d(out), lse_4d, 0.0,
            is_causal, attn_mask=_bias_4d(bias, _lead(query)), scale=scale)
        return tuple(_from_4d(grad, like) for grad, like in zip(grads, (query, key, value), strict=True))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        raise RuntimeError("scaled_dot_product_attention: the fused primitive's backward (PyTorch's fused CPU kernel) "
                           "has no derivative of its own; for second derivatives pin the functional composite: "
                           "use(pins={'scaled_dot_product_attention': 'functional'})")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise RuntimeError("scaled_dot_product_attention: the fused primitive's backward (PyTorch's fused CPU kernel) "
                           "has no forward derivative; for second derivatives pin the functional composite: "
                           "use(pins={'scaled_dot_product_attention': 'functional'})")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], grad_out, query, key, value, bias, out, lse, is_causal,
             scale):
        rank = query.dim() - (in_dims[1] is not None)
        grad_out, query, key, value, bias, out = batch_first(
            info, in_dims[:6], grad_out, query, key, value, bias, out, rank=rank)
        (lse,) = batch_first(info, in_dims[6:7], lse, rank=rank - 1)
        grads = apply(FusedAttentionBackward, grad_out, query, key, value, bias, out, lse, is_causal, scale)
        return grads, (0, 0, 0)


def _fused_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                dropout_p: float) -> bool:
    """Whether the fused kernel computes this call: no dropout (the CPU kernel has none), one head size, a float
    dtype, a CPU device, no empty dimension, a mask no wider than the query."""
    return (dropout_p == 0.0 and query.device.type == "cpu" and query.dtype in _FUSED_DTYPES
            and (attn_mask is None or attn_mask.dim() <= query.dim())
            and query.size(-1) == key.size(-1) == value.size(-1) and key.size(-2) == value.size(-2)
            and query.numel() > 0 and key.numel() > 0)


def _broadcast_leading(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       grouped: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value expanded to one shape of leading dimensions (the head dimension too, unless grouped),
    as native's matmuls broadcast them; an error in native's words where they do not broadcast."""
    keep = 3 if grouped and query.dim() >= 3 else 2
    shapes = [tuple(t.shape[:-keep]) for t in (query, key, value)]
    if shapes[0] == shapes[1] == shapes[2]:
        return query, key, value  # the common case, without torch.broadcast_shapes (about 15 us under vmap)
    try:
        lead = torch.broadcast_shapes(*shapes)
    except RuntimeError as error:
        raise RuntimeError(str(error).replace("Shape mismatch: objects cannot be broadcast to a single shape.  ", "")
                           ) from None
    return tuple(t if tuple(t.shape[:-keep]) == lead else t.expand(*lead, *t.shape[-keep:])
                 for t in (query, key, value))  # type: ignore[return-value]


@register("scaled_dot_product_attention", "primitive", function=FusedAttention)
def sdpa_primitive(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False):
    """FusedAttention: PyTorch's fused CPU kernel once over the whole batch, forward and backward."""
    check_attention(query, key, value, attn_mask, dropout_p, enable_gqa)
    if not _fused_fits(query, key, value, attn_mask, dropout_p):
        return sdpa_functional(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                               enable_gqa=enable_gqa)
    grouped = enable_gqa and query.dim() >= 3 and key.size(-3) != query.size(-3)
    query, key, value = _broadcast_leading(query, key, value, grouped)
    out, _ = apply(FusedAttention, query, key, value, additive_mask(attn_mask, query.dtype), is_causal,
                   scale_of(query, scale))
    return out


# --- the fused kernel's own overloads, reached under vmap without scaled_dot_product_attention ----------------------


@register_derivative("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu")
def flash_attention_for_cpu_folded(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """The fused forward once over the folded batch (FusedAttention), in place of vmap's per-sample loop."""
    if dropout_p != 0.0:
        raise RuntimeError("scaled_dot_product_attention_flash_attention: Currently do not support dropout > 0")
    return apply(FusedAttention, query, key, value, additive_mask(attn_mask, query.dtype), is_causal,
                 scale_of(query, scale))


@register_derivative("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu_backward")
def flash_attention_for_cpu_backward_folded(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                                            attn_mask=None, scale=None):
    """The fused backward once over the folded batch (FusedAttentionBackward): autograd calls it for native's
    gradient, and jacrev vmaps over it."""
    return apply(FusedAttentionBackward, grad_out, query, key, value, additive_mask(attn_mask, query.dtype), out,
                 logsumexp, is_causal, scale_of(query, scale))
