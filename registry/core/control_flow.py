"""Python control flow on a batched tensor inside ``use()``: proceed where every sample agrees, else split the batch.

``if mask.all():``, ``bool(t)``, ``t.item()``, ``float(t)``, ``torch.equal(a, b)`` turn a tensor into one Python
value. Under vmap the tensor holds one value per sample and PyTorch refuses ("It looks like you're attempting to use
a Tensor in some data-dependent control flow", "Batching rule not implemented for aten::equal"), even where every
sample gives the same value, which is common in model code (``if padding_mask.all():`` with no padding anywhere, a
shape or a count read with ``.item()``). Where all samples agree, the per-sample loop would have taken the same
branch or read the same number in every sample, so returning that value equals the loop exactly; where they differ,
``SamplesDisagreeError`` (its message names the user's line and the mask-based form, ``torch.where``) carries each
sample's value, and the level's vmap re-runs the function on the groups of samples that agree
(registry.core.batch_split).

The kernels sit at the functorch front key (``aten::is_nonzero``, ``aten::item``, ``aten::_local_scalar_dense``,
``aten::equal``): outside ``use()``, inside a composite, or where no vmap batches the tensor, PyTorch's own kernel
runs.

A write through a boolean mask of a batched tensor (``x[mask] = v``) has a shape that depends on the values; its
refusal is raised again as ``BooleanMaskError`` with the user's line and the fixed-shape forms.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _DisableFuncTorch  # noqa: PLC2701 - functorch's bindings have no public API

from registry.core.context import DISPATCH_KEY
from registry.core.disagree import SamplesDisagreeError, aligned, level_values
from registry.core.frames import calling_user_frame, raising_user_frame

# vmap's refusal of boolean-mask indexing (index.Tensor, index_put_ with a batched bool mask).
MASK_REFUSAL = "Attempting to batch over indexing with a boolean mask"

# The words every refusal here carries (tests and the survey can recognize them).
DISAGREE_PHRASE = "samples of the vmapped batch disagree"

_WHERE_ALTERNATIVE = ("compute both branches and pick per sample with a mask instead of an `if`: "
                      "torch.where(cond, if_true, if_false) (or x.masked_fill(~cond, value)), keeping cond a tensor")
_EQUAL_ALTERNATIVE = ("keep the comparison a tensor, (a == b).all() (with a.shape == b.shape checked outside the "
                      "function), and pick per sample with torch.where")
_ITEM_ALTERNATIVE = ("keep the value a tensor instead of a Python number (drop .item()/float()/int() and use it in "
                     "tensor ops, torch.where for a choice)")


def samples(tensor: torch.Tensor) -> torch.Tensor | None:
    """Every sample's value of a batched ``tensor``, the batch flattened into dim 0 (the innermost vmap's samples
    vary fastest); None if no vmap batches it or a wrapper cannot be peeled."""
    found = level_values(tensor)
    return None if found is None else found.flat()


def _agreed(values: torch.Tensor) -> bool:
    """Whether every entry of 1-d ``values`` is the same Python value (NaN agrees with NaN: each sample gives nan)."""
    with _DisableFuncTorch():
        if bool((values == values[:1]).all()):
            return True
        return (values.is_floating_point() or values.is_complex()) and bool(values.isnan().all())


def _site() -> str:
    frame = calling_user_frame()
    return frame.describe() if frame is not None else ""


def _disagree(call: str, detail: str, alternative: str, levels: tuple[int, ...],
              keys: torch.Tensor) -> SamplesDisagreeError:
    """The error (its message is today's clear one) carrying each sample's answer, by level, for the split."""
    site = _site()
    where = f" at {site}" if site else ""
    message = (f"vmap: {call}{where} needs one Python value, but the {DISAGREE_PHRASE} ({detail}), so no single "
               f"branch or number is right for all of them; {alternative}")
    return SamplesDisagreeError(message, levels, keys, site, alternative)


def _make_is_nonzero(native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed

    def kernel(keyset: Any, self: torch.Tensor) -> Any:
        if not routing_on():
            return call_native(keyset, self)
        found = level_values(self)
        if found is None or found.values.numel() == 0:
            return call_native(keyset, self)
        if self.numel() != 1:  # what each sample of the loop raises
            raise RuntimeError(f"Boolean value of Tensor with more than one value is ambiguous (each sample has "
                               f"{self.numel()} values)")
        with _DisableFuncTorch():
            truth = found.values.reshape(found.batch_shape) != 0
            count = int(truth.sum())
        if count in (0, truth.numel()):
            return count != 0
        raise _disagree("bool() of a tensor (an `if`, `and`, `or`, `not` or `while` on it)",
                        f"{count} of {truth.numel()} are True", _WHERE_ALTERNATIVE, found.levels, truth)

    kernel.__name__ = "multicomposite_is_nonzero"
    return kernel


def _make_scalar(name: str, native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed

    def kernel(keyset: Any, self: torch.Tensor) -> Any:
        if not routing_on():
            return call_native(keyset, self)
        found = level_values(self)
        if found is None or found.values.numel() == 0:
            return call_native(keyset, self)
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar (per sample)")
        flat = found.flat().reshape(-1)
        if _agreed(flat):
            with _DisableFuncTorch():
                return flat[0].item()
        with _DisableFuncTorch():
            shown = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in flat[:4].tolist())
            keys = found.values.reshape(found.batch_shape)
        more = ", ..." if flat.numel() > 4 else ""
        raise _disagree(".item() of a tensor (or float(), int())", f"values {shown}{more}", _ITEM_ALTERNATIVE,
                        found.levels, keys)

    kernel.__name__ = f"multicomposite_{name}"
    return kernel


def _make_equal(native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    """``torch.equal`` (one Python bool; vmap has no batching rule for it): each sample's answer, where they agree."""
    call_native = native.call_boxed

    def kernel(keyset: Any, self: torch.Tensor, other: torch.Tensor) -> Any:
        if not routing_on():
            return call_native(keyset, self, other)
        parts = [level_values(self), level_values(other)]
        if parts[0] is None and parts[1] is None:
            return call_native(keyset, self, other)
        levels, (left, right) = aligned(parts, [self, other])
        with _DisableFuncTorch():
            depth = len(levels)
            batch = torch.broadcast_shapes(left.shape[:depth], right.shape[:depth])
            left = left.expand(*batch, *left.shape[depth:]).reshape(-1, *left.shape[depth:])
            right = right.expand(*batch, *right.shape[depth:]).reshape(-1, *right.shape[depth:])
            answers = torch.tensor([torch.equal(a, b) for a, b in zip(left, right, strict=True)]).reshape(batch)
            count = int(answers.sum())
        if count in (0, answers.numel()):
            return count != 0
        raise _disagree("torch.equal (it returns one Python bool)", f"{count} of {answers.numel()} are True",
                        _EQUAL_ALTERNATIVE, levels, answers)

    kernel.__name__ = "multicomposite_equal"
    return kernel


class BooleanMaskError(RuntimeError):
    """Boolean-mask indexing of a batched tensor under vmap, with the user's line and the fixed-shape forms."""


def boolean_mask_message(error: BaseException) -> str:
    """vmap's refusal of boolean-mask indexing, with the user's line (from ``error``'s traceback: the refusal is
    caught where vmap's implementation returns, registry.core.functionalization, rather than by a kernel on every
    tensor index) and the fixed-shape forms."""
    frame = raising_user_frame(error.__traceback__)
    where = f" at {frame.describe()}" if frame is not None else ""
    return (f"vmap: boolean-mask indexing{where} returns a shape that depends on the values of a batched mask, so it "
            "cannot be batched (each sample would select a different number of elements). Keep the shape fixed: "
            "torch.where(mask, x, fill) or x.masked_fill(~mask, fill) to read, torch.where(mask, v, x) or "
            "x.masked_fill(mask, v) to write, (x * mask).sum() for a masked sum, or "
            "torch.nonzero_static(mask, size=N) to gather a fixed number N of elements. "
            f"PyTorch's refusal: {str(error).splitlines()[0]}")


def register(library: torch.library.Library, routing_on: Callable[[], bool]) -> None:
    """Register the kernels of ``is_nonzero``, ``item``, ``_local_scalar_dense`` and ``equal`` on ``library`` (once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        native = torch.library.get_kernel("aten::is_nonzero", DISPATCH_KEY)
        library.impl("is_nonzero", _make_is_nonzero(native, routing_on), DISPATCH_KEY, with_keyset=True)
        for name in ("item", "_local_scalar_dense"):
            native = torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY)
            library.impl(name, _make_scalar(name, native, routing_on), DISPATCH_KEY, with_keyset=True)
        native = torch.library.get_kernel("aten::equal", DISPATCH_KEY)
        library.impl("equal", _make_equal(native, routing_on), DISPATCH_KEY, with_keyset=True)
