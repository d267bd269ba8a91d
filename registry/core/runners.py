"""How a decision runs for one aten overload: what the Python kernels, the C++ backend's callbacks and
``decomposition_table()`` share.

A decision names a composite and its kind; an overload may be in place (``index_fill_``), and may take other
parameters than the op's own (``to.dtype``, translated by its ``adapt``). What runs is then one of three things:
PyTorch's own kernel (where the kind's ``runs_native`` says so: ``registry.core.kinds``), the composite on the adapted
arguments, or, for an in-place overload, the composite out of place followed by ``copy_`` into ``self``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from registry.core.model import Overload
from registry.core.ops import aten_schema

_PYTHON_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def runner(composite: Callable[..., Any], overload: Overload) -> Callable[..., Any]:
    """What runs ``composite`` for one overload: the composite itself where nothing adapts the call; for an in-place
    overload, the composite out of place, then ``copy_`` into ``self``."""
    adapt = overload.adapt
    if overload.inplace:
        def run_inplace(*args: Any, **kwargs: Any) -> Any:
            cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
            return args[0].copy_(composite(*cargs, **ckwargs))

        run_inplace.__name__ = f"{getattr(composite, '__name__', 'composite')}_for_{overload.name.replace('.', '_')}"
        return run_inplace
    if adapt is None:
        return composite

    def run_adapted(*args: Any, **kwargs: Any) -> Any:
        cargs, ckwargs = adapt(args, kwargs)
        return composite(*cargs, **ckwargs)

    run_adapted.__name__ = f"{getattr(composite, '__name__', 'composite')}_for_{overload.name.replace('.', '_')}"
    return run_adapted


def batches_in_place(overload: Overload) -> bool:
    """Whether ``overload`` is in place and functorch has a batching rule of its own for it (``masked_fill_.Scalar``,
    ``index_add_``): where the decision is PyTorch's own op, its in-place kernel then runs as it would without
    ``use()``. The in-place overloads without one (``masked_fill_.Tensor``) run the out-of-place op, then ``copy_``."""
    # NOTE: out of place then copy_ costs a full copy of self; on a 256 x 100 x 100 cdist under vmap(grad) (whose
    # backward calls masked_fill_) that copy made use() 0.8x native (measured).
    return overload.inplace and torch._C._dispatch_has_kernel_for_dispatch_key(overload.qualified_name,
                                                                               "FuncTorchBatched")


def records_autograd(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether autograd records this call (grad mode on, some tensor argument requires grad)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in (*args, *kwargs.values()))


class InplaceRefusalError(RuntimeError):
    """A routing kernel's refusal of an in-place op under vmap that would write a batched value into an unbatched
    self: PyTorch's own refusal, word for word (code that reads the text still recognises it), raised as its own type
    so that automatic functionalization (registry.core.functionalization) recognises it without reading it."""


def inplace_message(packet: str) -> str:
    """PyTorch's own error for an in-place op under vmap that would write a batched value into an unbatched self."""
    return (f"vmap: {packet}(self, *extra_args) is not possible because there exists a Tensor `other` in extra_args "
            "that has more elements than `self`. This happened due to `other` being vmapped over but `self` not being "
            f"vmapped over in a vmap. Please try to use out-of-place operators instead of {packet}. If said operator "
            "is being called inside the PyTorch framework, please file a bug report instead.")


def tensor_positions(qualified_name: str) -> tuple[int, ...]:
    """Positions of the Tensor parameters of an overload's schema."""
    schema = aten_schema(qualified_name)
    return tuple(i for i, arg in enumerate(schema.arguments) if str(arg.type) == "Tensor" and not arg.kwarg_only)


def rewrapped(args: tuple[Any, ...], positions: tuple[int, ...]) -> tuple[Any, ...] | None:
    """``args`` with Python numbers at Tensor positions made tensors again, or None when there are none.

    A "wrapped number" (the 0-d tensor C++ makes of a Python scalar, ``x * 2`` under vmap calls ``to`` on one) reaches
    a Python kernel as a Python number, and ``call_boxed`` then refuses it where the schema says Tensor. It goes back
    as a 0-d tensor of the dtype a wrapped number has (int64, float64, bool, complex128).
    """
    fixed = None
    count = len(args)
    for p in positions:
        if p < count and args[p].__class__ in _PYTHON_NUMBER_DTYPES:
            fixed = fixed or list(args)
            fixed[p] = torch.tensor(args[p], dtype=_PYTHON_NUMBER_DTYPES[args[p].__class__])
    return None if fixed is None else tuple(fixed)
