"""Helpers for primitives: ``torch.autograd.Function`` classes whose ``vmap`` rule re-applies the Function itself.

A primitive's vmap rule moves every batch dimension to the front and calls ``apply`` again one level down, so the
Function stays a single node for every transform above it (``grad(vmap(f))``, ``jacfwd``, ``hessian``): autograd never
sees its decomposition.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    CGradInterpreterPtr,
    CJvpInterpreterPtr,
    CVmapInterpreterPtr,
    RandomnessType,
    TransformType,
    _add_batch_dim,
    _unwrap_batched,
    _unwrap_for_grad,
    _wrap_for_grad,
    maybe_get_level,
    peek_interpreter_stack,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
    unwrap_if_dead,
)
from torch._functorch.utils import (  # noqa: PLC2701 - functorch's internals have no public API
    enable_single_level_autograd_function,
    unwrap_dead_wrappers,
)
from torch.autograd import forward_ad
from torch.autograd.forward_ad import _set_fwd_grad_enabled  # noqa: PLC2701 - what functorch calls

# Dimension order of each memory format, as a permutation of the logical dimensions.
_FORMAT_ORDER: dict[torch.memory_format, tuple[int, ...]] = {
    torch.channels_last: (0, 2, 3, 1),
    torch.channels_last_3d: (0, 2, 3, 4, 1),
}


def batch_first(info: Any, in_dims: tuple[int | None, ...], *tensors: Any, rank: int | None = None) -> list[Any]:
    """Each tensor with its batch dimension at 0 and of size ``info.batch_size`` (unbatched ones are expanded).

    With ``rank``, singleton dimensions are inserted after the batch dimension so that every tensor has ``rank``
    logical dimensions, which keeps right-aligned broadcasting between them intact.
    """
    moved = []
    for tensor, dim in zip(tensors, in_dims, strict=True):
        if not isinstance(tensor, torch.Tensor):
            moved.append(tensor)
            continue
        tensor = tensor.expand(info.batch_size, *tensor.shape) if dim is None else tensor.movedim(dim, 0)
        if rank is not None and tensor.dim() - 1 < rank:
            tensor = tensor[(slice(None),) + (None,) * (rank - tensor.dim() + 1)]
        moved.append(tensor)
    return moved


def zeros_if_none(tangent: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if tangent is None else tangent


def laid_out(tensor: torch.Tensor, memory_format: torch.memory_format | None, batch_ndim: int = 0) -> torch.Tensor:
    """A copy of ``tensor`` whose trailing (per-sample) dimensions are laid out in ``memory_format``.

    Built from ``permute`` and ``contiguous`` only, which have batching rules, so it works on a batched tensor and on
    a physical tensor with ``batch_ndim`` leading batch dimensions alike.
    """
    order = _FORMAT_ORDER.get(memory_format) if memory_format is not None else None
    if order is None or tensor.dim() - batch_ndim != len(order):
        if memory_format in (None, torch.preserve_format):
            return tensor.clone()
        return tensor.clone(memory_format=torch.contiguous_format if batch_ndim else memory_format)
    lead = tuple(range(batch_ndim))
    permutation = lead + tuple(batch_ndim + d for d in order)
    inverse = [0] * len(permutation)
    for position, dim in enumerate(permutation):
        inverse[dim] = position
    # clone, not contiguous(): a composite calling a covered op would re-enter the router (it passes through).
    return tensor.permute(permutation).clone(memory_format=torch.contiguous_format).permute(inverse)


def copy_laid_out(tensor: torch.Tensor, memory_format: torch.memory_format | None, batch_ndim: int = 0):
    """Like ``laid_out`` but through ``empty_strided`` and ``copy_``: the result is not a view.

    For a primitive's forward, which runs on plain tensors below every transform, where a view output would confuse
    forward AD ("tangent must have the same layout as primal").
    """
    order = _FORMAT_ORDER.get(memory_format) if memory_format is not None else None
    if order is None or tensor.dim() - batch_ndim != len(order):
        if memory_format in (None, torch.preserve_format) or batch_ndim:
            return tensor.clone()
        return tensor.clone(memory_format=memory_format)
    permutation = tuple(range(batch_ndim)) + tuple(batch_ndim + d for d in order)
    strides = [0] * tensor.dim()
    step = 1
    for dim in reversed(permutation):
        strides[dim] = step
        step *= tensor.shape[dim]
    out = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def is_laid_out(tensor: torch.Tensor, memory_format: torch.memory_format | None) -> bool:
    """Whether ``tensor`` already satisfies ``memory_format``; False where vmap cannot tell (then a copy is made)."""
    if memory_format in (None, torch.preserve_format):
        return True
    # vmap cannot answer is_contiguous for channels_last (NYI), and under torch.compile the failed query cannot even
    # be caught: a functorch-wrapped tensor is treated as not laid out, which costs one copy and no correctness.
    if torch.compiler.is_compiling() or maybe_get_level(tensor) != -1:
        return False
    return tensor.is_contiguous(memory_format=memory_format)


# --- a lighter functorch path for primitives ---------------------------------------------------------------------
#
# functorch runs an autograd.Function under its transforms through ``custom_function_call``, which for every call
# and every level builds a new single-level Function class, walks the arguments with pytree and inspects
# signatures: about 0.3 ms a level on this machine, several times the fused kernels' own time at 256 x 1,000.
# ``apply`` below does what it does, level by level, with the C++ interpreter API directly and a single-level
# class cached per (primitive, level): under vmap it unwraps the level's batch dimensions and calls the primitive's
# own vmap rule one level down; under grad and jvp it records one single-level node whose backward and jvp are the
# primitive's. A primitive's rules call ``apply`` (not ``Function.apply``) so that every level takes this path.

_single_level: dict[tuple[type, int, Any], type] = {}
_base_apply = torch._C._FunctionBase.__dict__["apply"]


class _VmapInfo(NamedTuple):
    batch_size: int
    randomness: str


_RANDOMNESS = {RandomnessType.Error: "error", RandomnessType.Same: "same", RandomnessType.Different: "different"}


@contextlib.contextmanager
def _lower() -> Iterator[None]:
    saved = pop_dynamic_layer_stack()
    try:
        yield
    finally:
        push_dynamic_layer_stack(saved)


def _single_level_function(function: type, level: int, key: Any) -> type:
    cached = _single_level.get((function, level, key))
    if cached is not None:
        return cached

    def forward(*operands: Any) -> Any:
        unwrapped = [_unwrap_for_grad(x, level) if isinstance(x, torch.Tensor) else x for x in operands]
        interpreter = peek_interpreter_stack()
        if key == TransformType.Grad:
            restore = contextlib.nullcontext() if CGradInterpreterPtr(interpreter).prevGradMode() else torch.no_grad()
        else:
            restore = (contextlib.nullcontext() if CJvpInterpreterPtr(interpreter).prevFwdGradMode()
                       else _set_fwd_grad_enabled(False))
        with torch.enable_grad(), _set_fwd_grad_enabled(True), restore, _lower():
            out = apply(function, *unwrapped)
        if isinstance(out, tuple):
            return tuple(_wrap_for_grad(each, level) for each in out)
        return _wrap_for_grad(out, level)

    def setup_context(ctx: Any, inputs: Any, output: Any) -> Any:
        return function.setup_context(ctx, inputs, output)

    def backward(ctx: Any, *grads: Any) -> Any:
        return function.backward(ctx, *grads)

    def jvp(ctx: Any, *tangents: Any) -> Any:
        return function.jvp(ctx, *tangents)

    generated = type(f"{function.__name__}Generated", (torch.autograd.function._SingleLevelFunction,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward), "jvp": staticmethod(jvp),
        "setup_context": staticmethod(setup_context)})
    _single_level[(function, level, key)] = generated
    return generated


def _recorded(args: tuple[Any, ...]) -> bool:
    """Whether autograd (backward or forward mode, outside torch.func) would record a call on ``args``."""
    if forward_ad._current_level >= 0:
        return True
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args)


def apply(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` for a primitive (an autograd.Function with its own vmap rule and one tensor
    output, or a tuple of tensors whose vmap rule returns a tuple of batch dimensions), through the lighter functorch
    path above under torch.func transforms."""
    if torch.compiler.is_compiling():  # Dynamo traces functorch's own path, not this one
        return function.apply(*args)
    interpreter = peek_interpreter_stack()
    if interpreter is None:
        args = unwrap_dead_wrappers(args)
        if not _recorded(args):
            # Below every transform with nothing for autograd to record (the levels above record their own nodes):
            # the forward itself, without the Function machinery (about 20 us a call).
            return function.forward(*args)
        # Autograd's own apply, without Function.apply's per-call inspect.signature (a primitive's forward takes
        # every argument positionally, with no defaults to bind).
        return _base_apply.__get__(None, function)(*args)
    # A tensor saved by a level that has exited (jacrev's backward runs after its grad level) is a dead wrapper:
    # read as what it wraps, as functorch does.
    args = tuple(unwrap_if_dead(x) if isinstance(x, torch.Tensor) else x for x in args)
    return TRANSFORM_RULES.get(interpreter.key(), _functionalize_rule)(function, interpreter, args)


# NOTE [one rule per transform]: functorch runs an autograd.Function under a transform by looking the innermost
# interpreter's TransformType up in a table (``custom_function_call.py_impl(TransformType.Vmap)``, one entry per
# transform); ``apply`` does the same with the lighter rules below. Each rule handles the innermost level and calls
# ``apply`` again one level down, so a primitive stays one node for every transform above it. A transform without an
# entry (functionalize) takes functorch's own path, ``function.apply``: the kinds' rules mark primitives invalid there.


def _vmap_rule(function: type, interpreter: Any, args: tuple[Any, ...]) -> Any:
    """Unwrap this level's batch dimensions and call the primitive's own vmap rule one level down."""
    level = interpreter.level()
    unwrapped, in_dims = [], []
    for x in args:
        if isinstance(x, torch.Tensor) and maybe_get_level(x) == level:
            value, dim = _unwrap_batched(x, level)
            unwrapped.append(value)
            in_dims.append(dim)
        else:
            unwrapped.append(x)
            in_dims.append(None)
    with _lower():
        if all(d is None for d in in_dims):
            return apply(function, *args)
        vmap_interpreter = CVmapInterpreterPtr(interpreter)
        info = _VmapInfo(vmap_interpreter.batchSize(), _RANDOMNESS[vmap_interpreter.randomness()])
        out, out_dim = function.vmap(info, tuple(in_dims), *unwrapped)
    if isinstance(out, tuple):  # several outputs: one batch dimension (or None) each
        return tuple(each if dim is None else _add_batch_dim(each, dim, level)
                     for each, dim in zip(out, out_dim, strict=True))
    return out if out_dim is None else _add_batch_dim(out, out_dim, level)


def _differentiating_rule(function: type, interpreter: Any, args: tuple[Any, ...]) -> Any:
    """grad and jvp: record one single-level node whose backward and jvp are the primitive's."""
    key = interpreter.key()
    level = interpreter.level()
    if not any(isinstance(x, torch.Tensor) and maybe_get_level(x) == level for x in args):
        with _lower():
            return apply(function, *args)
    lift = (CGradInterpreterPtr if key == TransformType.Grad else CJvpInterpreterPtr)(interpreter).lift
    lifted = [lift(x) if isinstance(x, torch.Tensor) else x for x in args]
    with enable_single_level_autograd_function():
        return _single_level_function(function, level, key).apply(*lifted)


def _functionalize_rule(function: type, interpreter: Any, args: tuple[Any, ...]) -> Any:
    return function.apply(*args)  # functionalize: functorch's own path (the rules mark primitives invalid there)


TRANSFORM_RULES: dict[Any, Callable[[type, Any, tuple[Any, ...]], Any]] = {
    TransformType.Vmap: _vmap_rule,
    TransformType.Grad: _differentiating_rule,
    TransformType.Jvp: _differentiating_rule,
    TransformType.Functionalize: _functionalize_rule,
}
