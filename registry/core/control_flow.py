"""Python control flow on a batched tensor inside ``use()``: proceed where every sample agrees, else say where and why.

``if mask.all():``, ``bool(t)``, ``t.item()``, ``float(t)`` turn a tensor into one Python value. Under vmap the
tensor holds one value per sample and PyTorch refuses ("It looks like you're attempting to use a Tensor in some
data-dependent control flow"), even where every sample gives the same value, which is common in model code
(``if padding_mask.all():`` with no padding anywhere, a shape or a count read with ``.item()``). Where all samples
agree, the per-sample loop would have taken the same branch or read the same number in every sample, so returning that
value equals the loop exactly; where they differ, no single Python value is right, and the error names the user's line
and the mask-based form (``torch.where``) that computes every sample's branch.

The kernels sit at the functorch front key (``aten::is_nonzero``, ``aten::item``, ``aten::_local_scalar_dense``):
outside ``use()``, inside a composite, or where no vmap batches the tensor, PyTorch's own kernel runs.

Boolean-mask indexing of a batched tensor (``x[mask]``, ``x[mask] = v``) has a shape that depends on the values; its
refusal is raised again as ``BooleanMaskError`` with the user's line and the fixed-shape forms.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _DisableFuncTorch
from torch._C._functorch import get_unwrapped, is_batchedtensor, maybe_get_bdim, maybe_get_level

from registry.core.frames import calling_user_frame, raising_user_frame

DISPATCH_KEY = "FuncTorchDynamicLayerFrontMode"

# vmap's refusal of boolean-mask indexing (index.Tensor, index_put_ with a batched bool mask).
MASK_REFUSAL = "Attempting to batch over indexing with a boolean mask"

# The words every refusal here carries (tests and the survey can recognize them).
DISAGREE_PHRASE = "samples of the vmapped batch disagree"

_WHERE_ALTERNATIVE = ("compute both branches and pick per sample with a mask instead of an `if`: "
                      "torch.where(cond, if_true, if_false) (or x.masked_fill(~cond, value)), keeping cond a tensor")
_ITEM_ALTERNATIVE = ("keep the value a tensor instead of a Python number (drop .item()/float()/int() and use it in "
                     "tensor ops, torch.where for a choice)")


def samples(tensor: torch.Tensor) -> torch.Tensor | None:
    """Every sample's value of a batched ``tensor``, the batch flattened into dim 0 (the innermost vmap's samples
    vary fastest); None if no vmap batches it or a wrapper cannot be peeled.

    Only the wrappers are read (``get_unwrapped``, ``maybe_get_bdim``): no op runs on a wrapped tensor, so no
    transform records anything. Each batched level inserts its batch dimension into the tensor below it; the positions
    of the dimensions found so far shift past it.
    """
    batch_dims: list[int] = []  # where the batch dimensions found so far are, in the tensor being unwrapped
    value = tensor
    while maybe_get_level(value) != -1:
        if is_batchedtensor(value):
            bdim = maybe_get_bdim(value)
            batch_dims = [dim + 1 if dim >= bdim else dim for dim in batch_dims]
            batch_dims.append(bdim)
        try:
            value = get_unwrapped(value)
        except RuntimeError:
            return None
    if not batch_dims:
        return None
    with _DisableFuncTorch():
        sample_dims = [dim for dim in range(value.dim()) if dim not in batch_dims]
        return value.permute(*reversed(batch_dims), *sample_dims).reshape(-1, *tensor.shape)


def _agreed(values: torch.Tensor) -> bool:
    """Whether every entry of 1-d ``values`` is the same Python value (NaN agrees with NaN: each sample gives nan)."""
    with _DisableFuncTorch():
        if bool((values == values[:1]).all()):
            return True
        return (values.is_floating_point() or values.is_complex()) and bool(values.isnan().all())


def _disagree_message(call: str, detail: str, alternative: str) -> str:
    frame = calling_user_frame()
    where = f" at {frame.describe()}" if frame is not None else ""
    return (f"vmap: {call}{where} needs one Python value, but the {DISAGREE_PHRASE} ({detail}), so no single branch "
            f"or number is right for all of them; {alternative}")


def _make_is_nonzero(native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed

    def kernel(keyset: Any, self: torch.Tensor) -> Any:
        if not routing_on():
            return call_native(keyset, self)
        values = samples(self)
        if values is None or values.shape[0] == 0:
            return call_native(keyset, self)
        if self.numel() != 1:  # what each sample of the loop raises
            raise RuntimeError(f"Boolean value of Tensor with more than one value is ambiguous (each sample has "
                               f"{self.numel()} values)")
        with _DisableFuncTorch():
            truth = values.reshape(-1) != 0
            count = int(truth.sum())
        if count in (0, truth.numel()):
            return count != 0
        raise RuntimeError(_disagree_message("bool() of a tensor (an `if`, `and`, `or`, `not` or `while` on it)",
                                             f"{count} of {truth.numel()} are True", _WHERE_ALTERNATIVE))

    kernel.__name__ = "multicomposite_is_nonzero"
    return kernel


def _make_scalar(name: str, native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed

    def kernel(keyset: Any, self: torch.Tensor) -> Any:
        if not routing_on():
            return call_native(keyset, self)
        values = samples(self)
        if values is None or values.shape[0] == 0:
            return call_native(keyset, self)
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar (per sample)")
        flat = values.reshape(-1)
        if _agreed(flat):
            with _DisableFuncTorch():
                return flat[0].item()
        with _DisableFuncTorch():
            shown = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in flat[:4].tolist())
        more = ", ..." if flat.numel() > 4 else ""
        raise RuntimeError(_disagree_message(".item() of a tensor (or float(), int())",
                                             f"values {shown}{more}", _ITEM_ALTERNATIVE))

    kernel.__name__ = f"multicomposite_{name}"
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
    """Register the kernels of ``is_nonzero``, ``item`` and ``_local_scalar_dense`` on ``library`` (once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        native = torch.library.get_kernel("aten::is_nonzero", DISPATCH_KEY)
        library.impl("is_nonzero", _make_is_nonzero(native, routing_on), DISPATCH_KEY, with_keyset=True)
        for name in ("item", "_local_scalar_dense"):
            native = torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY)
            library.impl(name, _make_scalar(name, native, routing_on), DISPATCH_KEY, with_keyset=True)
