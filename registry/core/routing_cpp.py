"""The C++ backend of the routing: what the compiled kernels (``kernels/routing.cpp``) call back into Python for.

A C++ kernel passes through, builds the decision key and looks it up without Python. It calls back only on a miss,
into the overload's *decider* (the same decision the Python kernel makes: ``PASS``, ``NATIVE`` or the callable that
runs the composite, which the kernel stores under the key), on a composite decision (that callable), and while
something traces (the overload's Python kernel, whole).

What it needs of the Python routing (the frames, the decision, the Python kernels) comes in as a ``PythonRouting``:
this module imports nothing of ``routing.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from registry.core import cost
from registry.core.context import vmap_active
from registry.core.model import Op, Overload
from registry.core.registration import DERIVATIVES

PASS, NATIVE = 0, 1  # the codes kernels/routing.cpp knows; anything else a decider returns is what to call


@dataclass(frozen=True)
class PythonRouting:
    """What the C++ kernels call back into, handed in by ``routing.py``."""

    dispatch_key: str
    frames: Callable[[], Sequence[Any]]  # this thread's use() frames, innermost last (policy, pins)
    # (op, frame, args, kwargs, compiling) -> (composite, kind, whether self covers the batching)
    decide: Callable[..., tuple[Callable[..., Any], str, bool]]
    records_autograd: Callable[[tuple[Any, ...], dict[str, Any]], bool]
    inplace_message: Callable[[str], str]  # PyTorch's error for a batched write into an unbatched self
    make_kernel: Callable[..., Callable[..., Any]]  # the Python kernel of an overload (what runs while tracing)
    make_derivative_kernel: Callable[..., Callable[..., Any]]


def _runner(composite: Callable[..., Any], overload: Overload) -> Callable[..., Any]:
    """What runs a composite decision for one overload: the composite itself where nothing adapts the call."""
    adapt = overload.adapt
    if overload.inplace:
        # An in-place variant computes the new value out of place, then writes it into self (routing.py says why).
        def run_inplace(*args: Any, **kwargs: Any) -> Any:
            cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
            return args[0].copy_(composite(*cargs, **ckwargs))

        return run_inplace
    if adapt is None:
        return composite

    def run_adapted(*args: Any, **kwargs: Any) -> Any:
        cargs, ckwargs = adapt(args, kwargs)
        return composite(*cargs, **ckwargs)

    return run_adapted


def _decider(python: PythonRouting, op: Op, overload: Overload, *, eager_autograd: bool) -> Callable[..., Any]:
    adapt = overload.adapt
    inplace = overload.inplace
    packet = overload.name.partition(".")[0]
    runners: dict[Callable[..., Any], Callable[..., Any]] = {}  # composite -> its runner, made once
    frames, decide_call, records_autograd = python.frames, python.decide, python.records_autograd

    def decide(*args: Any, **kwargs: Any) -> Any:
        frame = frames()[-1]  # the kernel calls only inside use()
        if frame.policy == "native":
            return PASS
        if eager_autograd and not records_autograd(args, kwargs):
            return PASS
        cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
        composite, kind, self_covers = decide_call(op, frame, cargs, ckwargs, False)
        if inplace and not self_covers:
            raise RuntimeError(python.inplace_message(packet))
        if (kind == "native" and not inplace) or (inplace and kind == "mutating"):
            return NATIVE
        runner = runners.get(composite)
        if runner is None:
            runner = runners[composite] = _runner(composite, overload)
        return runner

    return decide


def _derivative_decider(python: PythonRouting, functional: Callable[..., Any], op: Op,
                        name: str) -> Callable[..., Any]:
    frames, decide_call = python.frames, python.decide
    of_op = cost.derivative_arguments(op.name, name)  # None: always the functional form under vmap

    def decide(*args: Any, **kwargs: Any) -> Any:
        frame = frames()[-1]
        if frame.policy == "native" or not vmap_active():
            return PASS
        # Where the op itself runs natively at these sizes (selection by cost), so does its derivative.
        if of_op is not None and decide_call(op, frame, (), of_op(args, kwargs), False)[1] == "native":
            return PASS
        return functional

    return decide


def register(module: ModuleType, ops: list[Op], python: PythonRouting) -> None:
    """Register the C++ kernel of every overload of ``ops`` (and of their derivative ops)."""
    key = python.dispatch_key
    for op in ops:
        for overload in op.overloads:
            native = torch.library.get_kernel(overload.qualified_name, key)
            slow = python.make_kernel(op, overload, native)
            module.register(overload.name, key, key, _decider(python, op, overload, eager_autograd=False), slow)
            if overload.name in op.eager_autograd:
                native = torch.library.get_kernel(overload.qualified_name, "AutogradCPU")
                slow = python.make_kernel(op, overload, native, eager_autograd=True)
                module.register(overload.name, "Autograd", "AutogradCPU",
                                _decider(python, op, overload, eager_autograd=True), slow)
        for name, functional in DERIVATIVES[op.name].items():
            native = torch.library.get_kernel(f"aten::{name}", key)
            slow = python.make_derivative_kernel(name, functional, native)
            module.register(name, key, key, _derivative_decider(python, functional, op, name), slow)
