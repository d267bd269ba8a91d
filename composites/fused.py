"""Fused kernels of the primitives: the bodies their ``forward``, ``backward`` and ``jvp`` run on plain tensors, below
every transform (a primitive's vmap rule moves the batch dimensions to the front and re-applies the Function, so
these always see physical tensors with the batch dimensions leading).

Each body is written in the formulation that measured fastest on CPU (``python -m bench --pieces`` times each one
against a single pass over the same data, ``x * y``):

- ``select`` is ``torch.where`` on the values' bits, ``b ^ ((a ^ b) & -mask)``: exact (NaN payloads, infinities and
  -0.0 come out bit for bit as in the chosen input) and branchless, where ``torch.where`` with a random bool mask is
  a branchy scalar loop on this CPU; one pass of a C kernel (``native_kernels``), or integer ops in eager PyTorch
  where that kernel cannot run;
- ``scatter_in_order`` (masked_scatter) walks each row once with a running count of Trues (C), or finds each True's
  source element with a ``cumsum`` of the mask and a ``gather`` (eager), with no ``nonzero`` compaction;
- the index ops run PyTorch's own ``index_add`` / ``index_copy`` / ``index_select`` once over the whole batch (the
  1-d index is shared by every sample), one kernel each.

``kernel(body)`` can also hand out an Inductor-compiled body (``torch.compile``, C++ with gcc on CPU, dynamic in
shape so that no batch size recompiles), compiled once per dtype and device and cached; ``set_compile(True)`` or
``MULTICOMPOSITE_FUSED=compile`` turns that on for ``select``, and each body's first-call time (the compilation) is
kept in ``COMPILE_SECONDS``. It is off by default because measurement says so (``python -m bench --pieces
--compile``): on the development machine the compiled select took 1.48 ms warm against 0.43 ms for the eager bit
formulation (and 0.06 ms for one pass, ``x * y``), after 96 s of compilation; a second batch size reused the kernel
(0.02 s).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    is_legacy_batchedtensor,
    maybe_get_level,
)

from composites import native_kernels
from composites.shapes import broadcast_shape

aten = torch.ops.aten

# The integer dtype of each element size, whose bits a float is viewed as.
_INT_OF_SIZE: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The integer dtype whose bits stand for ``dtype``'s, or None where bit operations cannot (complex, bool)."""
    if dtype.is_complex or dtype == torch.bool:
        return None
    if dtype.is_floating_point:
        return _INT_OF_SIZE.get(dtype.itemsize)
    return dtype


def _wrapped(*tensors: torch.Tensor | None) -> bool:
    """Whether any tensor is still wrapped by a transform: a body runs on plain tensors under torch.func, but
    gradcheck's batched-gradient check runs backward under the legacy vmap mode, which calls it with batched
    tensors; those take the unfused path, which every op there has a batching rule for."""
    return any(t is not None and (maybe_get_level(t) != -1 or is_legacy_batchedtensor(t)) for t in tensors)


def select(mask: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, *,
           a_is_scratch: bool = False) -> torch.Tensor:
    """``torch.where(mask, a, b)`` bit for bit, with ``None`` standing for zero; all three broadcast.

    ``a`` and ``b`` have one dtype; at least one of them is a tensor. ``a_is_scratch``: ``a`` is the caller's
    temporary, which the result may be written into.
    """
    like = a if a is not None else b
    if like is None:
        raise ValueError("fused.select: at least one of a and b must be a tensor")
    dtype = like.dtype
    if torch.compiler.is_compiling() or _wrapped(mask, a, b):  # traced by Dynamo, or batched by legacy vmap
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero if a is None else a, zero if b is None else b)
    if _one_pass_ok(mask, a, b):
        return native_kernels.select(mask, a, b)
    # Bit views need the values in memory: apply lazy neg/conj views first (no copy when there are none).
    a = None if a is None else a.resolve_neg().resolve_conj()
    b = None if b is None else b.resolve_neg().resolve_conj()
    if dtype == torch.bool:
        if a is None:
            return torch.logical_and(b, torch.logical_not(mask))
        if b is None:
            return torch.logical_and(a, mask)
        return torch.logical_or(torch.logical_and(a, mask), torch.logical_and(b, torch.logical_not(mask)))
    bits = _bit_dtype(dtype)
    if bits is None:  # complex: no bit view with one integer per element
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero if a is None else a, zero if b is None else b)
    return kernel(_select_bits)(mask, a, b, bits, dtype, a_is_scratch)


def _select_bits(mask: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, bits: torch.dtype,
                 dtype: torch.dtype, a_is_scratch: bool = False) -> torch.Tensor:
    """The body of ``select`` for a dtype whose values are viewed as the integers ``bits``. In place on its own
    temporaries where their shape is already the result's: a fresh 1 MB tensor costs page faults, more than a pass."""
    keep = mask.to(bits)  # 1 where a is taken
    if a is None:  # b where the mask is False, else +0: b & (keep - 1)
        keep.sub_(1)
        out = keep.bitwise_and_(b.view(bits)) if _covers(keep, b) else torch.bitwise_and(b.view(bits), keep)
    elif b is None:  # a where the mask is True, else +0: a & -keep
        keep.neg_()
        out = keep.bitwise_and_(a.view(bits)) if _covers(keep, a) else torch.bitwise_and(a.view(bits), keep)
    else:  # b ^ ((a ^ b) & -keep)
        b_bits = b.view(bits)
        if a_is_scratch and _covers(a, b) and _covers(a, mask):
            out = a.view(bits).bitwise_xor_(b_bits)
        else:
            out = torch.bitwise_xor(a.view(bits), b_bits)
        out = out.bitwise_and_(keep.neg_()) if _covers(out, keep) else torch.bitwise_and(out, keep.neg_())
        out = out.bitwise_xor_(b_bits) if _covers(out, b) else torch.bitwise_xor(out, b_bits)
    return out.view(dtype) if bits != dtype else out


def _one_pass_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether the one-pass C kernel gives what the eager body gives, layout included: plain CPU tensors, and each
    that already has the result's shape is contiguous (the kernel writes a contiguous result)."""
    present = [t for t in tensors if t is not None]
    shape = broadcast_shape(*(t.shape for t in present))
    return (all(t.is_contiguous() for t in present if tuple(t.shape) == shape) and bool(shape)
            and native_kernels.usable(*present))


def _covers(target: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``other`` broadcasts to ``target``'s shape, so an in-place op on ``target`` can take it."""
    return tuple(target.shape) == broadcast_shape(target.shape, other.shape)


def scatter_in_order(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, batch_ndim: int) -> torch.Tensor:
    """masked_scatter of each sample: the k-th True of a sample's mask takes its source's k-th element.

    ``mask`` has ``self``'s shape; the first ``batch_ndim`` dimensions of all three are batch dimensions, the rest of
    ``source`` is flattened. The running count of Trues picks each position's source element (one gather), and an
    exact select keeps ``self`` where the mask is False.
    """
    lead = self.shape[:batch_ndim]
    flat_source = source.reshape(*lead, -1).resolve_neg().resolve_conj()
    if flat_source.shape[-1] == 0:  # then the mask has no True (native raises otherwise)
        if bool(mask.any()):
            raise RuntimeError("masked_scatter: the mask has more Trues than source has elements (source is empty)")
        return self.clone(memory_format=torch.contiguous_format)
    flat_mask = mask.reshape(*lead, -1)
    if _one_pass_ok(self, mask) and native_kernels.usable(source) and self.dim() > batch_ndim:
        return native_kernels.scatter_rows(self.reshape(*lead, -1), flat_mask, flat_source).reshape(self.shape)
    position = flat_mask.cumsum(-1)
    if bool((position[..., -1:] > flat_source.shape[-1]).any()):
        raise RuntimeError("masked_scatter: the mask has more Trues than source has elements; give each sample a "
                           "source with at least as many elements as its mask has Trues")
    # Position p (the count of Trues so far) takes source element p - 1: a source with one spare element in front
    # needs no clamping where no True came yet (those positions keep self).
    # On the bits: gather on bfloat16 rewrites NaN payloads (a NaN comes back as 0xFFFF).
    bits = _bit_dtype(flat_source.dtype)
    as_bits = (flat_source.view(bits) if bits is not None and bits != flat_source.dtype and not _wrapped(flat_source)
               else flat_source)
    placed = torch.nn.functional.pad(as_bits, (1, 0)).gather(-1, position)
    placed = (placed if as_bits is flat_source else placed.view(self.dtype)).reshape(self.shape)
    return select(mask, placed, self, a_is_scratch=True)


def gather_in_order(values: torch.Tensor, mask: torch.Tensor, source_shape: tuple[int, ...],
                    batch_ndim: int) -> torch.Tensor:
    """The adjoint of ``scatter_in_order``: each sample's values at its Trues, in order, then zeros, shaped like
    source. Positions that are False write to a spare slot that is dropped."""
    lead = values.shape[:batch_ndim]
    size = math.prod(source_shape[batch_ndim:])
    flat_mask = mask.reshape(*lead, -1)
    if _wrapped(values, mask):  # out of place, for the legacy vmap mode (see _wrapped)
        position = torch.where(flat_mask, flat_mask.cumsum(-1) - 1, size)
        picked = torch.where(mask, values, 0).reshape(*lead, -1)
        out = values.new_zeros(*lead, size + 1).scatter_add(-1, position, picked)
        return out[..., :size].reshape(source_shape)
    if _one_pass_ok(values, mask) and values.dim() > batch_ndim:
        picked = native_kernels.gather_rows(values.reshape(*lead, -1), flat_mask, size)
        return picked.reshape(source_shape).clone(memory_format=torch.contiguous_format)
    position = flat_mask.cumsum(-1).sub_(1)
    spare = torch.full((), size, dtype=position.dtype, device=position.device)
    target = select(flat_mask, position, spare)
    bits = _bit_dtype(values.dtype)  # on the bits: scatter_ on bfloat16 rewrites NaN payloads, as gather does
    flat_values = values.reshape(*lead, -1).resolve_neg().resolve_conj()
    flat_values = flat_values.view(bits) if bits is not None and bits != values.dtype else flat_values
    out = flat_values.new_zeros(*lead, size + 1)
    out.scatter_(-1, target, flat_values.expand(target.shape))
    return out[..., :size].view(values.dtype).reshape(source_shape).clone(memory_format=torch.contiguous_format)


def index_fill(self: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
    """``self`` with ``value`` (0 for None) at ``index`` (non-negative) along ``dim``: one ``index_copy`` over the
    batch. ``value`` broadcasts to ``self`` with ``index``'s length at ``dim`` (one value per sample)."""
    shape = list(self.shape)
    shape[dim] = index.numel()
    if value is None:
        filler = torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)
    else:
        filler = value.expand(shape)
    return aten.index_copy(self, dim, index, filler)


# --- optional Inductor compilation of the bodies -----------------------------------------------------------------

COMPILE_SECONDS: dict[tuple[str, str, str], float] = {}  # (body, dtype, device) -> first-call seconds
_compiled: dict[tuple[str, str, str], Callable[..., Any]] = {}
_compile_lock = threading.Lock()
_compile_enabled = os.environ.get("MULTICOMPOSITE_FUSED", "") == "compile"


def set_compile(enabled: bool) -> None:
    """Run the bodies Inductor-compiled (True) or eager (False, the default)."""
    global _compile_enabled
    _compile_enabled = enabled


def compile_enabled() -> bool:
    return _compile_enabled


def kernel(body: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``body`` as it runs now: itself, or (with compilation on) its Inductor kernel for the first tensor argument's
    dtype and device, compiled on first use with dynamic shapes and cached."""

    def run(*args: Any) -> torch.Tensor:
        if not _compile_enabled or torch.compiler.is_compiling():
            return body(*args)
        like = next((a for a in args if isinstance(a, torch.Tensor) and a.dtype != torch.bool), args[0])
        key = (body.__name__, str(like.dtype).removeprefix("torch."), like.device.type)
        compiled = _compiled.get(key)
        if compiled is None:
            with _compile_lock:
                compiled = _compiled.get(key)
                if compiled is None:
                    compiled = torch.compile(body, dynamic=True, fullgraph=True)
                    start = time.perf_counter()
                    out = compiled(*args)
                    COMPILE_SECONDS[key] = time.perf_counter() - start
                    _compiled[key] = compiled
                    return out
        return compiled(*args)

    run.__name__ = body.__name__
    run.__doc__ = body.__doc__
    return run
