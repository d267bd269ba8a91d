"""What is active around a call: the transform stack, and which arguments are batched."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    TransformType,
    get_interpreter_stack,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    maybe_get_bdim,
    maybe_get_level,
)

TRANSFORMS = ("vmap", "grad", "jvp", "functionalize", "autograd", "compile")
# NOTE: every kernel the routing registers sits at functorch's front key. The dispatcher reaches it before any
# transform's rule (vmap's batching, grad's and jvp's wrappers), so a kernel there sees the whole stack and can send a
# call elsewhere before a transform refuses or loops over it (docs/routing.md).
DISPATCH_KEY = "FuncTorchDynamicLayerFrontMode"
_NAMES_BY_KEY: dict[int, str] = {}  # int(TransformType) -> name: hashing the pybind enum itself costs a microsecond
_TRANSFORM_NAMES = {
    TransformType.Vmap: "vmap",
    TransformType.Grad: "grad",
    TransformType.Jvp: "jvp",
    TransformType.Functionalize: "functionalize",
}
_NAMES_BY_KEY.update({int(key): name for key, name in _TRANSFORM_NAMES.items()})
for _key in TransformType.__members__.values():
    _NAMES_BY_KEY.setdefault(int(_key), str(_key))


@dataclass(frozen=True)
class Context:
    """Everything the selector may key a decision on."""

    stack: tuple[str, ...]
    batched: tuple[str, ...] = ()  # tensor arguments batched at the innermost vmap level, by schema name
    dtype: torch.dtype | None = None
    device: str | None = None
    numel: int | None = None
    # False when, at some vmap level, another tensor argument is batched and ``self`` is not (and no functionalize
    # layer inside that level makes the write out of place): writing that argument into ``self`` cannot work there.
    self_covers_batching: bool = True
    tensors: tuple[str, ...] = ("self",)  # which arguments are tensors (``value`` may be a Python number)
    # The sizes an op's cost depends on (registry.core.cost): each tensor's per-sample shape, in ``tensors`` order,
    # and the number of samples the first one stands for (the product of its vmap batch sizes; 1 outside vmap).
    shapes: tuple[tuple[int, ...], ...] = ()
    batch_size: int = 1
    # The other arguments set away from their schema default (``memory_format``): a rule may depend on them.
    given: tuple[str, ...] = ()
    # Whether this package's C++ batching rules are in effect for the call (registry.core.batch_rules: the C++
    # routing backend with its rules on, inside use(), a policy other than native): where one serves PyTorch's own
    # op, which vmap would otherwise loop, a choice by cost (registry.core.cost) weighs native's time with it.
    native_batch_rules: bool = False


def functorch_stack() -> tuple[tuple[str, int], ...]:
    # The C++ interpreter list, outermost first: no Python wrapper objects (retrieve_all_functorch_interpreters
    # builds one per level, three times the cost on the routing path).
    interpreters = get_interpreter_stack() or ()
    return tuple((_NAMES_BY_KEY[int(i.key())], i.level()) for i in interpreters)


def vmap_active() -> bool:
    """Whether a vmap level is on the functorch stack (at any depth)."""
    return any(transform == "vmap" for transform, _ in functorch_stack())


def current_stack(*tensors: Any) -> tuple[str, ...]:
    """The active transforms, outermost first.

    ``compile`` while Dynamo traces; ``autograd`` when grad mode is on and one of ``tensors`` requires grad outside
    any functorch ``grad``; then the functorch transforms (``vmap``, ``grad``, ``jvp``, ``functionalize``).
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the interpreter stack; the compiled graph is transformed as a whole.
        return ("compile", "autograd") if _records_autograd(tensors) else ("compile",)
    functorch = tuple(name for name, _ in functorch_stack())
    if "grad" not in functorch and _records_autograd(tensors):
        return ("autograd", *functorch)
    return functorch


def _records_autograd(tensors: Iterable[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def vmap_levels(tensor: torch.Tensor) -> tuple[int, ...]:
    """The vmap levels at which ``tensor`` carries a batch dimension, outermost wrapper first (so innermost level
    first). A tuple: the router hashes it on every routed call."""
    levels: tuple[int, ...] = ()
    while (level := maybe_get_level(tensor)) != -1:
        if is_batchedtensor(tensor):
            levels += (level,)
        try:
            tensor = get_unwrapped(tensor)
        except RuntimeError:  # a wrapper functorch cannot peel (functionalization): nothing batched below it
            break
    return levels


def innermost(tensor: torch.Tensor) -> torch.Tensor:
    """What every functorch level's wrapper of ``tensor`` wraps (``tensor`` itself where none does)."""
    while is_functorch_wrapped_tensor(tensor):
        tensor = get_unwrapped(tensor)
    return tensor


def batch_size(tensor: torch.Tensor) -> int:
    """The number of samples ``tensor`` stands for: the product of its batch sizes at every vmap level."""
    samples = 1
    while maybe_get_level(tensor) != -1:
        if is_batchedtensor(tensor):
            bdim = maybe_get_bdim(tensor)
            tensor = get_unwrapped(tensor)
            samples *= tensor.size(bdim)
            continue
        try:
            tensor = get_unwrapped(tensor)
        except RuntimeError:  # a wrapper functorch cannot peel (functionalization): nothing batched below it
            break
    return samples


def size_key(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """The power-of-two size buckets of a call, as the routing key holds them (kernels/routing.cpp builds the same):
    per tensor, each per-sample dimension's bit length, then each vmap batch size's, -1 between tensors. Decisions by
    cost (registry.core.cost) differ between buckets, so a decision is cached per bucket."""
    key: list[int] = []
    for tensor in tensors:
        key.extend(size.bit_length() for size in tensor.shape)
        while maybe_get_level(tensor) != -1:
            if is_batchedtensor(tensor):
                bdim = maybe_get_bdim(tensor)
                tensor = get_unwrapped(tensor)
                key.append(-2 - tensor.size(bdim).bit_length())
                continue
            try:
                tensor = get_unwrapped(tensor)
            except RuntimeError:
                break
        key.append(-1)
    return tuple(key)


def context_of(
    tensor_args: dict[str, torch.Tensor],
    functorch: tuple[tuple[str, int], ...] | None = None,
    *,
    compiling: bool | None = None,
    records: bool | None = None,
    given: tuple[str, ...] = (),
    native_batch_rules: bool = False,
) -> Context:
    """The context of a call whose tensor arguments, by schema name, are ``tensor_args`` (``self`` first).

    ``functorch``: the interpreter stack as ``functorch_stack()`` gives it; ``compiling``: whether torch.compile is
    tracing; ``records``: whether autograd records the call — each computed here when the caller does not have it;
    ``native_batch_rules``: whether the C++ batching rules would serve PyTorch's own op (``Context``).
    Under torch.compile the routing kernels run while AOTAutograd traces, with the functorch stack in place: the
    stack is then ``compile`` followed by the transforms inside the compiled function.
    """
    tensors = tuple(tensor_args.values())
    if functorch is None:
        functorch = functorch_stack()
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if records is None:
        records = _records_autograd(tensors)
    names = tuple(name for name, _ in functorch)
    stack = ("autograd", *names) if "grad" not in names and records else names
    if compiling:
        stack = ("compile", *stack)
    first = tensors[0] if tensors else None
    batched: tuple[str, ...] = ()
    covers = True
    if "vmap" in names:
        innermost = max(level for name, level in functorch if name == "vmap")
        levels = {name: frozenset(vmap_levels(t)) for name, t in tensor_args.items()}
        batched = tuple(name for name, lv in levels.items() if innermost in lv)
        self_levels = levels.get("self", frozenset())
        # A functionalize layer inside a vmap level turns the in-place write into an out-of-place one before that
        # level sees it: self need not be batched there.
        functionalized = max((level for name, level in functorch if name == "functionalize"), default=-1)
        covers = all(level < functionalized for lv in levels.values() for level in lv - self_levels)
    return Context(
        stack=stack,
        batched=batched,
        dtype=first.dtype if first is not None else None,
        device=first.device.type if first is not None else None,
        numel=first.numel() if first is not None else None,
        self_covers_batching=covers,
        tensors=tuple(tensor_args),
        shapes=tuple(tuple(t.shape) for t in tensors),
        batch_size=batch_size(first) if first is not None and "vmap" in names else 1,
        given=given,
        native_batch_rules=native_batch_rules,
    )


def given_arguments(defaults: dict[str, Any], params: tuple[str, ...], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The names of a call's non-tensor arguments that are away from their schema ``defaults`` (name -> default;
    ``params``: the schema's parameter names in order)."""
    given = [name for name, value in zip(params, args, strict=False)
             if name in defaults and not isinstance(value, torch.Tensor) and value != defaults[name]]
    given += [name for name, value in kwargs.items()
              if name in defaults and not isinstance(value, torch.Tensor) and value != defaults[name]]
    return tuple(given)


# What an op's forward sees under each: jacrev is vjp (grad), then a vmap over the backward only; jacfwd is vmap over
# jvp; hessian is jacfwd(jacrev).
STACK_ALIASES: dict[str, tuple[str, ...]] = {
    "jacrev": ("grad",),
    "jacfwd": ("vmap", "jvp"),
    "hessian": ("vmap", "jvp", "grad"),
}
