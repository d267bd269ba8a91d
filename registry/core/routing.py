"""``use()``: route calls of covered ops to the selected composite, through every entry point.

Only the covered entry points (``torch.Tensor.index_fill``, ``torch.index_fill``, ...) are patched, and only while
some thread is inside ``use()``: uncovered ops never pass through Python, and outside ``use()`` PyTorch's own
functions are back in place. The patched function checks a thread-local frame stack, so other threads see plain
PyTorch even while one thread routes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch._C._functorch import peek_interpreter_stack

from registry.core.context import Context, _functorch_stack, context_of, vmap_levels
from registry.core.model import KINDS, Op
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES, load
from registry.core.selector import CACHE_LISTENERS, POLICIES, SelectionError, decide, unknown_op_message


class _Frame:
    __slots__ = ("compiled", "keys", "pins", "policy")

    def __init__(self, policy: str, pins: dict[str, str]) -> None:
        self.policy = policy
        self.pins = pins
        # The eager cache key's prefix per op, interned to an int: hashing it costs nothing on the hot path.
        self.keys = {op: _PREFIXES.setdefault((op, policy, pins.get(op)), len(_PREFIXES)) for op in OPS}
        # Decided here, eagerly, because Dynamo cannot trace the selector: what runs while torch.compile traces.
        self.compiled: dict[str, Callable[..., Any]] = {}
        for op in OPS:
            try:
                decision = decide(op, Context(stack=("compile",), tensors=OPS[op].tensor_args), policy, pins.get(op))
            except SelectionError as error:  # raised where the op is compiled, not at use() entry
                self.compiled[op] = functools.partial(_raise, error)
            else:
                self.compiled[op] = decision.fn


_PREFIXES: dict[tuple[str, str, str | None], int] = {}


class _Local(threading.local):
    frames: list[_Frame] | tuple[()] = ()  # a class default: threads that never entered use() read it directly


_local = _Local()
_patch_lock = threading.Lock()
_active_frames = 0  # over all threads; the patches are installed while it is positive
_patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, PyTorch's original)

# (interned (op, policy, pin), dtype, value is a tensor, size bucket) -> (composite when autograd does not record,
# composite when it does); None means "call PyTorch's original". Only contexts without a functorch transform are
# cached here: the common eager path costs one dict lookup, and checks requires_grad only where the two differ.
_eager_cache: dict[tuple, tuple[Callable[..., Any] | None, Callable[..., Any] | None]] = {}
CACHE_LISTENERS.append(_eager_cache.clear)


def _raise(error: Exception, *args: Any, **kwargs: Any) -> Any:
    raise error


def _frames() -> list[_Frame]:
    if not isinstance(_local.frames, list):
        _local.frames = []
    return _local.frames


def _tensor_args(op: Op, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    # zip stops at the shorter: positional arguments cover a prefix of the parameters.
    found = {name: value for name, value in zip(op.params, args, strict=False) if isinstance(value, torch.Tensor)}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found[name] = value
    return found


# (interned prefix, functorch stack, tensor arguments, their vmap levels, dtype, device, size, autograd records) ->
# composite or None: the functorch path's cache, so that a vmap'd call pays for the context, not for a decision.
_functorch_cache: dict[tuple, Callable[..., Any] | None] = {}
CACHE_LISTENERS.append(_functorch_cache.clear)


def _decide_fn(op: Op, frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """The context, then the decision (both cached): None means PyTorch's original."""
    tensors = _tensor_args(op, args, kwargs)
    functorch = _functorch_stack()
    self = tensors.get("self")
    records = torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values())
    levels = tuple(vmap_levels(t) for t in tensors.values())
    key = (frame.keys[op.name], functorch, tuple(tensors), levels, getattr(self, "dtype", None),
           getattr(self, "device", None), self.numel().bit_length() if self is not None else 0, records)
    try:
        return _functorch_cache[key]
    except KeyError:
        pass
    decision = decide(op.name, context_of(tensors, functorch), frame.policy, frame.pins.get(op.name))
    fn = _functorch_cache[key] = None if decision.kind == "native" else decision.fn
    return fn


def _eager_pair(op: Op, frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """The eager decisions without and with autograd recording, for the eager cache."""
    ctx = context_of(_tensor_args(op, args, kwargs))
    pair = []
    for stack in ((), ("autograd",)):
        decision = decide(op.name, replace(ctx, stack=stack), frame.policy, frame.pins.get(op.name))
        pair.append(None if decision.kind == "native" else decision.fn)
    return tuple(pair)


def _make_router(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
    normalize = op.normalize
    name = op.name
    # Where the op takes a Python number or a tensor (``value``), that choice is part of the eager cache key.
    value_position = op.params.index("value") if "value" in op.params else None
    # Only these can require grad (index and mask are integer and bool): the eager path checks nothing else.
    grad_positions = tuple(op.params.index(p) for p in op.tensor_args if p not in ("index", "mask"))
    is_tensor = torch.Tensor.__instancecheck__
    is_grad_enabled = torch.is_grad_enabled
    is_compiling = torch.compiler.is_compiling
    local = _local

    def records_autograd(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if not is_grad_enabled():
            return False
        if kwargs:
            return any(is_tensor(v) and v.requires_grad for v in (*args, *kwargs.values()))
        n_args = len(args)
        return any(p < n_args and is_tensor(args[p]) and args[p].requires_grad for p in grad_positions)

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        frames = local.frames
        if not frames or frames[-1].policy == "native":
            return original(*args, **kwargs)
        frame = frames[-1]
        if is_compiling():
            call = normalize(args, kwargs)
            return original(*args, **kwargs) if call is None else frame.compiled[name](*call[0], **call[1])
        call = normalize(args, kwargs)
        if call is None:  # out=, a named dim, an overload the composites do not model
            return original(*args, **kwargs)
        cargs, ckwargs = call
        if peek_interpreter_stack() is None:
            self = cargs[0] if cargs else ckwargs.get("self")
            value_kind = None
            if value_position is not None:
                value = cargs[value_position] if len(cargs) > value_position else ckwargs.get("value")
                value_kind = is_tensor(value)
            # Profiles are kept per power-of-two size, so the size is part of the key. The device is not: reading it
            # costs a fifth of the 2 us budget, and validity never depends on it (only which valid one is fastest).
            size = self.numel().bit_length() if is_tensor(self) else 0
            key = (frame.keys[name], getattr(self, "dtype", None), value_kind, size)
            pair = _eager_cache.get(key)
            if pair is None:
                pair = _eager_cache[key] = _eager_pair(op, frame, cargs, ckwargs)
            plain, recording = pair
            composite = plain if plain is recording or not records_autograd(cargs, ckwargs) else recording
        else:
            composite = _decide_fn(op, frame, cargs, ckwargs)
        if composite is None:
            return original(*args, **kwargs)
        return composite(*cargs, **ckwargs)

    routed.__multicomposite_original__ = original  # type: ignore[attr-defined]
    return routed


def _install() -> None:
    for op in OPS.values():
        for owner, attribute in op.entry_points:
            original = getattr(owner, attribute)
            _patched.append((owner, attribute, original))
            setattr(owner, attribute, _make_router(op, original))


def _uninstall() -> None:
    while _patched:
        owner, attribute, original = _patched.pop()
        setattr(owner, attribute, original)


def _validate(policy: str, pins: Mapping[str, str] | None) -> dict[str, str]:
    if policy not in POLICIES:
        raise SelectionError(f"use(): unknown policy {policy!r}; policies are {', '.join(POLICIES)}")
    checked = dict(pins or {})
    for op, pin in checked.items():
        if op not in OPS:
            raise SelectionError(f"use(pins=...): {unknown_op_message(op)}")
        if pin not in COMPOSITES[op] and pin not in KINDS:
            raise SelectionError(
                f"use(pins=...): {op} has no composite or kind {pin!r}; registered: {', '.join(COMPOSITES[op])}"
            )
    return checked


class use(contextlib.ContextDecorator):  # noqa: N801 - used like a function: `with registry.use():`
    """Route covered ops to the selected composite: ``with use():`` or ``@use()``; nests (inner wins), per thread.

    ``policy``: ``auto`` (default), ``rules``, or ``native`` (route nothing, for A/B). ``pins`` forces a kind or a
    composite per op, ``{"index_fill": "functional"}``; a pin invalid where the op is called raises.
    """

    def __init__(self, policy: str = "auto", pins: Mapping[str, str] | None = None) -> None:
        load()
        self.policy = policy
        self.pins = _validate(policy, pins)

    def __enter__(self) -> use:
        global _active_frames
        with _patch_lock:
            if _active_frames == 0:
                _install()
            _active_frames += 1
        _frames().append(_Frame(self.policy, self.pins))
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _active_frames
        _frames().pop()
        with _patch_lock:
            _active_frames -= 1
            if _active_frames == 0:
                _uninstall()


def routing_active() -> bool:
    """Whether the current thread is inside ``use()``."""
    return bool(_local.frames)
