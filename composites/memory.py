"""Composites of the memory family: ``contiguous`` and ``to`` (dtype, device and memory-format conversion).

Both return ``self`` itself when nothing needs converting, as PyTorch does; a copy is made only otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from composites.checks import check_contiguous, check_to
from registry.core import rules
from registry.core.ops import TO_ADAPTERS, overloads
from registry.core.primitive import batch_first, copy_laid_out, is_laid_out, laid_out
from registry.core.registration import define_op, register

# Composites call the dispatcher directly, never a covered entry point that use() may have patched,
# and Dynamo traces it under torch.compile.
aten = torch.ops.aten


# --- the ops: one entry each, with what is known of where PyTorch's own kernel and the clone-and-mutate form fail --


def _memory_format_fails(op: str) -> rules.Rule:
    # Only where the call sets memory_format (Context.given): with its default, PyTorch's op batches under vmap and
    # runs with no Python frame at all, where a composite would cost one.
    return rules.fails_when(lambda ctx: rules.under_vmap(ctx) and "memory_format" in ctx.given, "error",
                            f"{op} with a memory_format other than contiguous_format fails under vmap (NYI: "
                            "is_contiguous / clone(memory_format) inside vmap)")


define_op("contiguous", "", tensors=("self",), doc="self laid out in memory_format, self itself when it already is",
          rules={"native": _memory_format_fails("contiguous")})
define_op("to", "dtype_layout", tensors=("self",), doc="self converted to dtype, device and memory_format",
          overloads=overloads("to", adapters=TO_ADAPTERS),
          rules={"native": _memory_format_fails("to"),
                 "mutating": rules.fails_when(lambda ctx: "jvp" in ctx.stack, "mismatch",
                                              "copy_'s forward-AD formula keeps the source's dtype, so the tangent "
                                              "of a dtype-changing to comes out in the wrong dtype")})

# --- contiguous --------------------------------------------------------------------------------------------------


@register("contiguous", "mutating")
def contiguous_mutating(self, *, memory_format=torch.contiguous_format):
    """empty_like in the memory format, then copy_ in place."""
    check_contiguous(self, memory_format)
    if is_laid_out(self, memory_format):
        return self
    return torch.empty_like(self, memory_format=memory_format).copy_(self)


@register("contiguous", "functional")
def contiguous_functional(self, *, memory_format=torch.contiguous_format):
    """permute, contiguous, permute back: a copy in the memory format from ops that vmap can batch."""
    check_contiguous(self, memory_format)
    if is_laid_out(self, memory_format):
        return self
    return laid_out(self, memory_format)


class LaidOut(Function):
    """A copy of self in a memory format (or converted to dtype/device) as one autograd node: identity gradients."""

    generate_vmap_rule = False

    @staticmethod
    def forward(self: torch.Tensor, dtype: torch.dtype | None, device: Any, memory_format: Any, batch_ndim: int):
        converted = self
        if (dtype is not None and dtype != self.dtype) or (device is not None and torch.device(device) != self.device):
            converted = aten._to_copy(self, dtype=dtype, device=device)
        if converted is self or not is_laid_out(converted, memory_format):
            return copy_laid_out(converted, memory_format, batch_ndim)
        return converted

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self = inputs[0]
        ctx.source_dtype, ctx.source_device = self.dtype, self.device
        ctx.dtype, ctx.device = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return aten._to_copy(grad, dtype=ctx.source_dtype, device=ctx.source_device), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, self_t, _dtype, _device, _memory_format, _batch_ndim) -> torch.Tensor:
        return aten._to_copy(self_t, dtype=ctx.dtype, device=ctx.device)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], self, dtype, device, memory_format, batch_ndim):
        (self,) = batch_first(info, in_dims[:1], self)
        return LaidOut.apply(self, dtype, device, memory_format, batch_ndim + 1), 0


@register("contiguous", "primitive", function=LaidOut)
def contiguous_primitive(self, *, memory_format=torch.contiguous_format):
    """LaidOut: one autograd node with its own backward, jvp and vmap rules."""
    check_contiguous(self, memory_format)
    if is_laid_out(self, memory_format):
        return self
    return LaidOut.apply(self, None, None, memory_format, 0)


# --- to ----------------------------------------------------------------------------------------------------------


def _needs_copy(self: torch.Tensor, dtype, device, copy, memory_format) -> bool:
    return (
        copy
        or (dtype is not None and dtype != self.dtype)
        or (device is not None and torch.device(device) != self.device)
        or not is_laid_out(self, memory_format)
    )


@register("to", "mutating")
def to_mutating(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, copy=False,
                memory_format=None):
    """empty_like with the target dtype, device and memory format, then copy_ in place."""
    check_to(self, layout, memory_format)
    if not _needs_copy(self, dtype, device, copy, memory_format):
        return self
    target = torch.empty_like(self, dtype=dtype, device=device, memory_format=memory_format or torch.preserve_format)
    return target.copy_(self, non_blocking=non_blocking)


@register("to", "functional")
def to_functional(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, copy=False,
                  memory_format=None):
    """_to_copy for dtype and device, then permute-contiguous for the memory format."""
    check_to(self, layout, memory_format)
    if not _needs_copy(self, dtype, device, copy, memory_format):
        return self
    converted = aten._to_copy(self, dtype=dtype, device=device, non_blocking=non_blocking)
    if is_laid_out(converted, memory_format):
        return converted
    return laid_out(converted, memory_format)


@register("to", "primitive", function=LaidOut)
def to_primitive(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, copy=False,
                 memory_format=None):
    """LaidOut: one autograd node with its own backward, jvp and vmap rules."""
    check_to(self, layout, memory_format)
    if not _needs_copy(self, dtype, device, copy, memory_format):
        return self
    return LaidOut.apply(self, dtype, device, memory_format, 0)
