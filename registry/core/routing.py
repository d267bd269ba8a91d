"""``use()``: route every call of a covered op to the selected composite, at PyTorch's dispatcher.

A Python kernel is registered once, process-wide, for every aten overload of every covered op (in-place variants
included) at the ``FuncTorchDynamicLayerFrontMode`` dispatch key. The dispatcher reaches that key only while some
functorch transform is active (``vmap``, ``grad``, ``jvp``, ``functionalize``, and the transforms ``jacrev``,
``jacfwd`` and ``hessian`` are made of), before autograd and batching see the call. So every caller is routed: a
function object captured before ``use()`` (``from torch import masked_scatter``), a C++ caller (``index_select``'s
backward calls ``index_add``), an in-place variant. A composite run there sends its own ops through every transform
layer, so its derivative and its batching come from those ops.

``use()`` itself only pushes a frame (policy, pins) on a thread-local stack that the kernels read: the kernels of a
thread outside ``use()`` fall straight through to PyTorch's own, and eager code (no transform) never reaches them.

Two backends run the same kernels: compiled C++ (``kernels/routing.cpp``, ``routing_cpp.py``: the pass-through, the
decision key and its lookup without Python; Python only decides a miss and runs a composite), and the Python kernels
below, used where no compiler is available or with ``MULTICOMPOSITE_ROUTING=python``. ``routing_backend()`` says
which is active.

One entry point cannot be reached at the dispatcher: ``Tensor.contiguous(memory_format=...)`` asks
``is_contiguous(memory_format)`` in C++ before dispatching, which raises under vmap. A Python wrapper sends a call
with a memory format other than ``contiguous_format`` to ``aten::contiguous`` (same result outside transforms), where
the kernel routes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
from torch._C._functorch import maybe_current_level

from registry.core import control_flow, dynamic, functionalization, inplace_under_jvp, out_arguments
from registry.core.collector import collection_paused
from registry.core.context import context_of, functorch_stack, vmap_active, vmap_levels
from registry.core.model import KINDS, Op, Overload
from registry.core.ops import OPS, ORIGINAL, aten_schema
from registry.core.registration import COMPOSITES, DERIVATIVES, load
from registry.core.selector import CACHE_LISTENERS, POLICIES, SelectionError, decide, unknown_op_message

DISPATCH_KEY = "FuncTorchDynamicLayerFrontMode"


class _Frame:
    """What ``use()`` pushed: the policy and pins the kernels read. Interned per (policy, pins)."""

    __slots__ = ("id", "pins", "policy", "prefixes", "signature")

    def __init__(self, policy: str, pins: dict[str, str]) -> None:
        self.id = len(_FRAMES) + 1  # what the C++ kernels read (0: no frame)
        self.policy = policy
        self.pins = pins
        self.signature = (policy, tuple(sorted(pins.items())))
        # The decision cache key's prefix per op, interned to an int: hashing it costs nothing on the hot path.
        self.prefixes = _Prefixes(policy, pins)


_PREFIXES: dict[tuple[str, str, str | None], int] = {}


class _Prefixes(dict):
    """op -> the interned (op, policy, pin) of a frame; an op defined after the frame was made (a plugin) is interned
    on its first call."""

    def __init__(self, policy: str, pins: dict[str, str]) -> None:
        super().__init__()
        self.policy = policy
        self.pins = pins

    def __missing__(self, op: str) -> int:
        prefix = self[op] = _PREFIXES.setdefault((op, self.policy, self.pins.get(op)), len(_PREFIXES))
        return prefix
_FRAMES: dict[tuple[str, tuple[tuple[str, str], ...]], _Frame] = {}


class _Local(threading.local):
    # Class defaults: a thread that never entered use() reads them without creating anything.
    frames: list[_Frame] | tuple[()] = ()
    busy = False  # inside a composite or a native call this thread's kernel already decided: pass through


_local = _Local()

# (interned (op, policy, pin), functorch stack, compiling, tensor argument names, their vmap levels, dtype, device
# type, size bucket, autograd records) -> (composite, kind, whether self is batched wherever another argument is).
_decisions: dict[tuple, tuple[Callable[..., Any], str, bool]] = {}
CACHE_LISTENERS.append(_decisions.clear)

# Routing signatures ((policy, pins), or None outside use()) under which torch.compile traced through a kernel. A
# graph bakes in the composite chosen while it was traced, and Dynamo does not guard on use(): when the routing
# changes, compiled graphs traced under another routing are dropped so that they are traced again.
_traced_signatures: set[tuple[str, tuple[tuple[str, str], ...]] | None] = set()

_register_lock = threading.Lock()
_libraries: list[torch.library.Library] = []  # the dynamic-shape refusals' (kept for the process)
_python_library: list[torch.library.Library] = []  # the Python backend's kernels, while it is active
_refusing: set[str] = set()  # dynamic-shape overloads refused under vmap (registry.core.dynamic)
_routed_ops: set[str] = set()  # ops whose overloads have routing kernels (ops defined later get theirs at use())
_python_calls: dict[str, int] = {}  # what the Python kernels decided

BACKEND_ENV = "MULTICOMPOSITE_ROUTING"  # "python" forces the Python kernels; "cpp" makes a failed build an error
_backend: list[str] = []  # the active backend once kernels are registered: "cpp" or "python"
_cpp: ModuleType | None = None  # the compiled kernels' module while the C++ backend is active
_set_frame: Callable[[int], None] | None = None  # _cpp.set_frame while the C++ backend is active


class _KernelCalls(Mapping[str, int]):
    """Overload name -> calls that a routing kernel decided (either backend), since ``clear()``; tests read it."""

    def _counts(self) -> dict[str, int]:
        counts = dict(_python_calls)
        if _cpp is not None:
            for name, calls in _cpp.calls().items():
                counts[name] = counts.get(name, 0) + calls
        return counts

    def __getitem__(self, name: str) -> int:
        return self._counts()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts())

    def __len__(self) -> int:
        return len(self._counts())

    def clear(self) -> None:
        _python_calls.clear()
        if _cpp is not None:
            _cpp.clear_calls()


KERNEL_CALLS = _KernelCalls()


def _tensor_args(op: Op, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    # zip stops at the shorter: positional arguments cover a prefix of the parameters.
    found = {name: value for name, value in zip(op.params, args, strict=False) if isinstance(value, torch.Tensor)}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found[name] = value
    return found


def _decide(op: Op, frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any], compiling: bool,
            ) -> tuple[Callable[..., Any], str, bool]:
    """(composite, kind, self covers the batching) for this call: the cache key, then on a miss the context and the
    decision. The key costs a few reads of C++ state: the interpreter stack and each tensor's wrapper levels."""
    tensors = _tensor_args(op, args, kwargs)
    functorch = functorch_stack()
    values = tuple(tensors.values())
    first = values[0] if values else None
    records = torch.is_grad_enabled() and any(t.requires_grad for t in values)
    key = (frame.prefixes[op.name], functorch, compiling, tuple(tensors), tuple(map(vmap_levels, values)),
           None if first is None else first.dtype, None if first is None else first.device.type,
           0 if first is None else first.numel().bit_length(), records)
    try:
        return _decisions[key]
    except KeyError:
        pass
    ctx = context_of(tensors, functorch, compiling=compiling, records=records)
    decision = decide(op.name, ctx, frame.policy, frame.pins.get(op.name))
    chosen = _decisions[key] = (decision.fn, decision.kind, ctx.self_covers_batching)
    return chosen


_PYTHON_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _tensor_positions(qualified_name: str) -> tuple[int, ...]:
    """Positions of the Tensor parameters of an overload's schema."""
    schema = aten_schema(qualified_name)
    return tuple(i for i, arg in enumerate(schema.arguments) if str(arg.type) == "Tensor" and not arg.kwarg_only)


def _rewrapped(args: tuple[Any, ...], positions: tuple[int, ...]) -> tuple[Any, ...] | None:
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


def _make_kernel(op: Op, overload: Overload, native: Any, *, eager_autograd: bool = False) -> Callable[..., Any]:
    """The routing kernel of one overload; ``eager_autograd``: the one at the Autograd key, which routes only while
    autograd records (outside transforms, where the functorch kernel is never reached)."""
    call_native = native.call_boxed
    tensor_positions = _tensor_positions(overload.qualified_name)
    adapt = overload.adapt
    inplace = overload.inplace
    local = _local
    is_compiling = torch.compiler.is_compiling
    name = overload.name
    packet = name.partition(".")[0]

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        rewrapped = _rewrapped(args, tensor_positions)
        if rewrapped is not None:  # a wrapped number: PyTorch's own kernel, never a composite
            return call_native(keyset, *rewrapped, **kwargs)
        frames = local.frames
        if not frames or local.busy:
            if not frames and is_compiling():
                _traced_signatures.add(None)
            return call_native(keyset, *args, **kwargs)
        frame = frames[-1]
        compiling = is_compiling()
        if compiling:
            _traced_signatures.add(frame.signature)
        if frame.policy == "native":
            return call_native(keyset, *args, **kwargs)
        if eager_autograd and not _records_autograd(args, kwargs):
            return call_native(keyset, *args, **kwargs)
        cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
        composite, kind, self_covers = _decide(op, frame, cargs, ckwargs, compiling)
        _python_calls[name] = _python_calls.get(name, 0) + 1
        if inplace and not self_covers:
            raise RuntimeError(_inplace_message(packet))
        # The layers below this one reach this kernel again with the same call: it is decided here, once.
        local.busy = True
        try:
            if kind == "native" and not inplace:
                return call_native(keyset, *args, **kwargs)
            if inplace and kind == "mutating":  # clone-then-in-place is what PyTorch's in-place op does already
                return call_native(keyset, *args, **kwargs)
            # An in-place variant computes the new value out of place (PyTorch's own out-of-place op where the
            # decision is native: in-place variants lack batching rules that the out-of-place ones have), then
            # writes it into self.
            result = composite(*cargs, **ckwargs)
            return args[0].copy_(result) if inplace else result
        finally:
            local.busy = False

    kernel.__name__ = f"multicomposite_{name.replace('.', '_')}"
    return kernel


def _routing_on() -> bool:
    """Inside ``use()`` with a policy that routes, and not inside a composite or a decided native call."""
    frames = _local.frames
    if not frames or _local.busy or frames[-1].policy == "native":
        return False
    return _cpp is None or not _cpp.busy()


def _records_autograd(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in (*args, *kwargs.values()))


def _make_derivative_kernel(name: str, functional: Callable[..., Any], native: Any) -> Callable[..., Any]:
    """A derivative op (``masked_scatter_backward``): its functional form under vmap, where PyTorch's kernel has no
    batching rule and loops; PyTorch's own kernel everywhere else."""
    call_native = native.call_boxed
    local = _local
    tensor_positions = _tensor_positions(name)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        rewrapped = _rewrapped(args, tensor_positions)
        if rewrapped is not None:
            return call_native(keyset, *rewrapped, **kwargs)
        frames = local.frames
        if not frames or local.busy or frames[-1].policy == "native":
            return call_native(keyset, *args, **kwargs)
        if not vmap_active():
            return call_native(keyset, *args, **kwargs)
        _python_calls[name] = _python_calls.get(name, 0) + 1
        local.busy = True
        try:
            return functional(*args, **kwargs)
        finally:
            local.busy = False

    kernel.__name__ = f"multicomposite_{name.replace('.', '_')}"
    return kernel


def _inplace_message(packet: str) -> str:
    """PyTorch's own error for an in-place op under vmap that would write a batched value into an unbatched self."""
    return (f"vmap: {packet}(self, *extra_args) is not possible because there exists a Tensor `other` in extra_args "
            "that has more elements than `self`. This happened due to `other` being vmapped over but `self` not being "
            f"vmapped over in a vmap. Please try to use out-of-place operators instead of {packet}. If said operator "
            "is being called inside the PyTorch framework, please file a bug report instead.")


def _contiguous(self: torch.Tensor, *, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """Tensor.contiguous, with other memory formats sent through ``aten::contiguous`` where ``use()`` routes them.

    PyTorch's binding asks ``self.is_contiguous(memory_format)`` before it dispatches, which raises under vmap for
    channels_last; ``aten::contiguous`` asks the same question after dispatch, so outside any transform the result is
    the same (``self`` itself when it is laid out already, else a copy).
    """
    if memory_format is torch.contiguous_format and not torch.compiler.is_compiling():
        return _original_contiguous(self)  # Dynamo cannot trace the C method when it is called unbound
    return torch.ops.aten.contiguous.default(self, memory_format=memory_format)


_original_contiguous = ORIGINAL.Tensor.contiguous
_contiguous.__doc__ = _original_contiguous.__doc__


def register_kernels() -> None:
    """Register the routing kernels, once per process (``use()`` calls it; it costs about 12 us an overload), on the
    C++ backend where it builds or loads, else on the Python one."""
    if _libraries and len(_routed_ops) == len(OPS):
        return
    with _register_lock:
        load()
        if _libraries and len(_routed_ops) == len(OPS):
            return
        if not _backend:
            _backend.append(_choose_backend())
        new = [op for op in OPS.values() if op.name not in _routed_ops]
        with collection_paused():  # collector.py says why
            _register_routing(new)
        _routed_ops.update(op.name for op in new)
        if not _libraries:
            library = torch.library.Library("aten", "IMPL")
            dynamic.register(library, _routing_on, _refusing)
            control_flow.register(library, _routing_on)
            functionalization.install(_routing_on)
            out_arguments.install(library, _routing_on, {o.name for op in OPS.values() for o in op.overloads})
            inplace_under_jvp.install(library, _routing_on)
            torch.Tensor.contiguous = _contiguous  # type: ignore[method-assign]
            _libraries.append(library)  # every Library object stays alive: dropping one unregisters its kernels
        else:
            dynamic.register(_libraries[0], _routing_on, _refusing)


def _choose_backend() -> str:
    """"cpp" when the compiled kernels build or load; else "python", saying once why and how to get the fast path."""
    global _cpp
    wanted = os.environ.get(BACKEND_ENV, "").strip().lower()
    if wanted not in ("", "cpp", "python"):
        raise SelectionError(f"{BACKEND_ENV}={wanted!r}: expected cpp or python (or unset: cpp where it builds)")
    if wanted == "python":
        return "python"
    from registry.core import kernels

    try:
        _cpp = kernels.load()
    except kernels.KernelBuildError as error:
        if wanted == "cpp":
            raise
        warnings.warn(f"multicomposite: use() runs its Python routing kernels (a few microseconds more per call "
                      f"under a transform): {error}; or set {BACKEND_ENV}=python to choose them", stacklevel=4)
        return "python"
    CACHE_LISTENERS.append(_cpp.clear)
    return "cpp"


def _register_routing(ops: list[Op]) -> None:
    """Register the routing kernels of ``ops`` on the active backend."""
    global _set_frame
    if _backend[0] == "cpp":
        from registry.core import routing_cpp

        if _cpp is None:
            raise RuntimeError("routing: the C++ backend is active but its kernels are not loaded; report this bug")
        python = routing_cpp.PythonRouting(
            dispatch_key=DISPATCH_KEY, frames=lambda: _local.frames, decide=_decide,
            records_autograd=_records_autograd, inplace_message=_inplace_message, make_kernel=_make_kernel,
            make_derivative_kernel=_make_derivative_kernel)
        routing_cpp.register(_cpp, ops, python)
        _set_frame = _cpp.set_frame
        return
    if not _python_library:
        _python_library.append(torch.library.Library("aten", "IMPL"))
    library = _python_library[0]
    with warnings.catch_warnings():
        # PyTorch warns once that a kernel overrides FuncTorchDynamicLayerFrontMode's: that is the point here.
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        for op in ops:
            for overload in op.overloads:
                native = torch.library.get_kernel(overload.qualified_name, DISPATCH_KEY)
                library.impl(overload.name, _make_kernel(op, overload, native), DISPATCH_KEY, with_keyset=True)
                if overload.name in op.eager_autograd:
                    # The Autograd alias key: one registration for every backend's autograd key. The native
                    # kernel there is VariableType's, the same function for every backend.
                    native = torch.library.get_kernel(overload.qualified_name, "AutogradCPU")
                    library.impl(overload.name, _make_kernel(op, overload, native, eager_autograd=True),
                                 "Autograd", with_keyset=True)
            for name, functional in DERIVATIVES[op.name].items():
                native = torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY)
                library.impl(name, _make_derivative_kernel(name, functional, native), DISPATCH_KEY,
                             with_keyset=True)


def set_routing_kernels(registered: bool) -> None:
    """Remove (False) or put back (True) the routing kernels of the active backend, outside ``use()``: what a
    benchmark compares a process with and without (``bench.routing``'s (r0)). The kernels are registered first."""
    if _local.frames:
        raise RuntimeError("set_routing_kernels: called inside use(); call it outside")
    register_kernels()
    with _register_lock:
        present = bool(_python_library) if _backend[0] == "python" else _cpp is not None and _cpp.registered()
        if registered == present:
            return
        if registered:
            _register_routing([OPS[name] for name in _routed_ops])
        elif _backend[0] == "python":
            for library in _python_library:
                library._destroy()
            _python_library.clear()
        elif _cpp is not None:
            _cpp.unregister_all()


def routing_backend() -> str:
    """Which kernels route ``use()``: ``"cpp"`` (compiled) or ``"python"``; registers them if nothing has yet."""
    register_kernels()
    return _backend[0]


def set_routing_backend(backend: str) -> None:
    """Route on ``backend`` ("cpp" or "python") from now on, in this process (tests and benchmarks run both).

    Outside ``use()`` only. Raises KernelBuildError when "cpp" cannot be built or loaded."""
    global _cpp, _set_frame
    if backend not in ("cpp", "python"):
        raise SelectionError(f"set_routing_backend: unknown backend {backend!r}; backends are cpp, python")
    if _local.frames:
        raise RuntimeError("set_routing_backend: called inside use(); switch backends outside it")
    register_kernels()
    if _backend[0] == backend:
        return
    with _register_lock:
        if backend == "cpp":
            from registry.core import kernels

            module = kernels.load()
            for library in _python_library:
                library._destroy()
            _python_library.clear()
            _cpp = module
            if module.clear not in CACHE_LISTENERS:
                CACHE_LISTENERS.append(module.clear)
        elif _cpp is not None:
            _cpp.unregister_all()
            _cpp.set_frame(0)
            _cpp.clear()
            _set_frame = None
        _backend[0] = backend
        _register_routing([OPS[name] for name in _routed_ops])
        _decisions.clear()


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


def _frame(policy: str, pins: Mapping[str, str] | None) -> _Frame:
    key = (policy, tuple(sorted(pins.items())) if pins else ())
    frame = _FRAMES.get(key)
    if frame is None:
        frame = _FRAMES[key] = _Frame(policy, _validate(policy, pins))
    return frame


def _drop_graphs_traced_elsewhere(signature: tuple[str, tuple[tuple[str, str], ...]] | None) -> None:
    """Forget compiled graphs traced under a routing other than ``signature`` (they baked in its composites)."""
    if _traced_signatures - {signature}:
        torch._dynamo.reset()
        _traced_signatures.clear()


class use(contextlib.ContextDecorator):  # noqa: N801 - used like a function: `with registry.use():`
    """Route covered ops to the selected composite: ``with use():`` or ``@use()``; nests (inner wins), per thread.

    ``policy``: ``auto`` (default), ``fastest``, ``rules``, or ``native`` (route nothing, for A/B). ``pins`` forces a
    kind or a composite per op, ``{"index_fill": "functional"}``; a pin invalid where the op is called raises there.
    Calls are routed under torch.func transforms, where PyTorch's own kernels raise, loop or go wrong; outside any
    transform PyTorch's own kernel runs.
    """

    __slots__ = ("_frame",)

    def __init__(self, policy: str = "auto", pins: Mapping[str, str] | None = None) -> None:
        if len(_routed_ops) != len(OPS) or not _libraries:
            register_kernels()
        self._frame = _frame(policy, pins)

    @property
    def policy(self) -> str:
        return self._frame.policy

    @property
    def pins(self) -> dict[str, str]:
        return dict(self._frame.pins)

    def __enter__(self) -> use:
        local = _local
        frames = local.frames
        if frames.__class__ is tuple:
            frames = local.frames = []
        frames.append(self._frame)
        if _set_frame is not None:
            _set_frame(self._frame.id)
        if _traced_signatures:
            _drop_graphs_traced_elsewhere(self._frame.signature)
        return self

    def __exit__(self, *exc_info: object) -> None:
        frames = _local.frames
        frames.pop()
        if _set_frame is not None:
            _set_frame(frames[-1].id if frames else 0)
        if _traced_signatures:
            _drop_graphs_traced_elsewhere(frames[-1].signature if frames else None)


def routing_active() -> bool:
    """Whether the current thread is inside ``use()``."""
    return bool(_local.frames)


def under_transform() -> bool:
    """Whether some functorch transform is active on this thread (where the routing kernels are reached)."""
    return maybe_current_level() is not None
