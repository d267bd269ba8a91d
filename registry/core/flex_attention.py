"""``flex_attention`` under vmap inside ``use()``: the vmap dimensions fold into its batch dimension.

``torch.nn.attention.flex_attention.flex_attention`` runs its higher-order operator (``flex_attention`` HOP), which
has no vmap rule: under vmap it fails, natively ("Dynamo failed to run FX node with fake tensors: call_function
flex_attention(*(BatchedTensor(...". The rule below, registered on the HOP for functorch's vmap and active only
inside ``use()``, moves each batched argument's vmap dimension to the front and folds it into the batch dimension
(``(V, B, H, L, E)`` -> ``(V * B, H, L, E)``), runs the HOP one level down and unfolds the outputs. The score mod and
the block mask's mask mod see the batch index they would see per sample (``b % B``); a tensor they capture that is
batched at the level is read at the sample's row (``buffer[b // B]``); block-mask tensors with a batch dimension of
their own are repeated for each vmap sample (or folded, when the block mask itself is batched).

On CPU PyTorch 2.13 has no flex_attention backward ("FlexAttention does not support backward on CPU"), natively
too: under grad-containing stacks it fails as natively. See docs/functions.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    TransformType,
    _add_batch_dim,
    _unwrap_batched,
)
from torch._higher_order_ops.flex_attention import (  # noqa: PLC2701 - the flex_attention operator
    flex_attention as flex_attention_hop,
)


def _front(tensor: Any, level: int) -> tuple[Any, bool]:
    """``tensor``'s physical form with the vmap dimension of ``level`` first, and whether it had one."""
    if not isinstance(tensor, torch.Tensor):
        return tensor, False
    value, dim = _unwrap_batched(tensor, level)
    if dim is None:
        return value, False
    return value.movedim(dim, 0), True


def _fold(tensor: torch.Tensor, batched: bool, vmap_size: int, batch: int) -> torch.Tensor:
    """A (V, B', ...) or (B', ...) tensor as (V * B, ...): B' == B, or B' == 1 broadcast to B."""
    if not batched:
        tensor = tensor.expand(vmap_size, *tensor.shape)
    if tensor.shape[1] != batch:
        tensor = tensor.expand(vmap_size, batch, *tensor.shape[2:])
    return tensor.reshape(vmap_size * batch, *tensor.shape[2:])


def _sample_buffers(buffers: tuple[Any, ...], level: int) -> tuple[list[Any], list[bool]]:
    fronted = [_front(buffer, level) for buffer in buffers]
    return [value for value, _ in fronted], [batched for _, batched in fronted]


def _folded_mod(mod: Callable[..., Any], batch: int, batched: list[bool], with_score: bool) -> Callable[..., Any]:
    """``mod`` seeing the per-sample batch index, and each batched captured buffer at the sample's row."""

    def folded(*args: Any) -> Any:
        lead = 5 if with_score else 4
        indices, buffers = args[:lead], args[lead:]
        b = indices[1] if with_score else indices[0]
        sample = b // batch
        per_sample = [buffer[sample] if is_batched else buffer for buffer, is_batched in zip(buffers, batched,
                                                                                              strict=True)]
        if with_score:
            score, _, h, m, n = indices
            return mod(score, b % batch, h, m, n, *per_sample)
        _, h, m, n = indices
        return mod(b % batch, h, m, n, *per_sample)

    return folded


def _folded_block_mask(block_mask: tuple[Any, ...], level: int, vmap_size: int, batch: int,
                       mask_batched: list[bool]) -> tuple[Any, ...]:
    folded: list[Any] = []
    for item in block_mask[:-1]:
        if not isinstance(item, torch.Tensor):
            folded.append(item)
            continue
        value, batched = _front(item, level)
        if batched:
            folded.append(_fold(value, True, vmap_size, batch) if value.shape[1] in (1, batch) else
                          value.reshape(-1, *value.shape[2:]))
        elif value.dim() >= 1 and value.shape[0] == batch and batch > 1:
            folded.append(value.repeat(vmap_size, *([1] * (value.dim() - 1))))
        else:
            folded.append(value)  # a batch dimension of 1 broadcasts over the folded batch
    folded.append(_folded_mod(block_mask[-1], batch, mask_batched, with_score=False))
    return tuple(folded)


def _vmap_rule(interpreter: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable,
               block_mask: tuple, scale: float, kernel_options: dict[str, Any],
               score_mod_other_buffers: tuple = (), mask_mod_other_buffers: tuple = ()) -> tuple[Any, ...]:
    level = interpreter.level()
    vmap_size = interpreter.batch_size()
    q, q_batched = _front(query, level)
    k, k_batched = _front(key, level)
    v, v_batched = _front(value, level)
    batch = (q.shape[1] if q_batched else q.shape[0])
    q = _fold(q, q_batched, vmap_size, batch)
    k = _fold(k, k_batched, vmap_size, batch)
    v = _fold(v, v_batched, vmap_size, batch)
    score_buffers, score_batched = _sample_buffers(tuple(score_mod_other_buffers), level)
    mask_buffers, mask_batched = _sample_buffers(tuple(mask_mod_other_buffers), level)
    folded_score = _folded_mod(score_mod, batch, score_batched, with_score=True)
    folded_mask = _folded_block_mask(tuple(block_mask), level, vmap_size, batch, mask_batched)
    with interpreter.lower():
        outputs = flex_attention_hop(q, k, v, folded_score, folded_mask, scale, kernel_options,
                                     tuple(score_buffers), tuple(mask_buffers))
    unfolded = []
    for output in outputs:
        if isinstance(output, torch.Tensor) and output.dim() >= 1 and output.shape[0] == vmap_size * batch:
            output = _add_batch_dim(output.reshape(vmap_size, batch, *output.shape[1:]), 0, level)
        unfolded.append(output)
    return tuple(unfolded)


class FlexAttentionPatch:
    """The vmap rule on the HOP (``registry.core.patches.Patch``): registered by ``install``, removed by
    ``uninstall``; outside ``use()`` it fails as the missing rule does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed

    def vmap_rule(self, interpreter: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        active = self.active
        if active is None or not active():
            # What PyTorch's dispatch raises where the HOP has no vmap rule: outside use() nothing changes.
            raise KeyError(TransformType.Vmap)
        return _vmap_rule(interpreter, *args, **kwargs)

    def install(self, active: Callable[[], bool]) -> None:
        with self.lock:
            self.active = active
            if TransformType.Vmap not in flex_attention_hop.functorch_table:
                flex_attention_hop.py_impl(TransformType.Vmap)(self.vmap_rule)

    def uninstall(self) -> None:
        """Remove the vmap rule: the HOP is as PyTorch made it."""
        with self.lock:
            if self.active is not None:
                flex_attention_hop.functorch_table.pop(TransformType.Vmap, None)
            self.active = None


PATCH = FlexAttentionPatch()  # the default registry's (``Router.patches``)
