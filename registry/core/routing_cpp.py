"""The C++ backend of the routing: what the compiled kernels (``kernels/routing.cpp``) call back into Python for.

A C++ kernel passes through, builds the decision key and looks it up without Python. It calls back only on a miss,
into the overload's *decider* (the same decision the Python kernel makes: ``PASS``, ``NATIVE`` or the callable that
runs the composite, which the kernel stores under the key), on a composite decision (that callable), and while
something traces or the frame records (the overload's Python kernel, whole).

What it needs of the Python routing comes in as the router itself (``PythonRouting``: its frames, its decision, its
Python kernels and its op table's derivative ops): this module imports nothing of ``routing.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch

from registry.core import cost
from registry.core.context import DISPATCH_KEY, vmap_active
from registry.core.model import Op, Overload
from registry.core.runners import InplaceRefusalError, batches_in_place, inplace_message, records_autograd, runner

# The codes kernels/routing.cpp knows; a decider returns one of them, the name of a C++ op to call with the call's
# arguments as they are (a cpp_op composite's redirect), or the Python callable to call.
PASS, NATIVE = 0, 1


class PythonRouting(Protocol):
    """What the C++ kernels call back into: ``routing.Router``."""

    local: Any  # this thread's use() frames (``.frames``, innermost last)
    table: Any  # the op table (``.derivatives``, ``.signatures``)
    # (op, frame, args, kwargs, compiling) -> (composite, (out of place, in place) -> runs PyTorch's own kernel,
    # whether self covers the batching, recorded)
    decide: Callable[..., tuple[Callable[..., Any], tuple[bool, bool], bool, Any]]

    def make_kernel(self, op: Op, overload: Overload, native: Any, *, eager_autograd: bool = False,
                    ) -> Callable[..., Any]: ...

    def make_derivative_kernel(self, op: str, name: str, functional: Callable[..., Any], native: Any,
                               ) -> Callable[..., Any]: ...


def redirect_target(redirect: str, overload: Overload) -> str | None:
    """``redirect``'s overload named as ``overload``'s ("multicomposite::masked_fill" for aten::masked_fill.Scalar:
    "multicomposite::masked_fill.Scalar"), or the one ``redirect`` names after a dot
    ("multicomposite::masked_scatter.entry"); None where that overload is missing or its argument types are not the
    aten overload's. An in-place overload (masked_fill_.Scalar) finds its out-of-place twin's (the same overload
    name, the same argument types)."""
    namespace, _, packet_name = redirect.partition("::")
    packet_name, _, name = packet_name.partition(".")
    if not name:
        _, _, name = overload.name.partition(".")
    packet = getattr(getattr(torch.ops, namespace), packet_name, None)
    if packet is None or (name or "default") not in packet.overloads():
        return None
    ours, theirs = getattr(packet, name or "default")._schema, overload.op_overload._schema
    if [str(a.type) for a in ours.arguments] != [str(a.type) for a in theirs.arguments]:
        return None
    return f"{namespace}::{packet_name}.{name}" if name else redirect


def _decider(router: PythonRouting, op: Op, overload: Overload, *, eager_autograd: bool) -> Callable[..., Any]:
    adapt = overload.adapt
    inplace = overload.inplace
    native_in_place = batches_in_place(overload)
    packet = overload.name.partition(".")[0]
    runners: dict[Callable[..., Any], Callable[..., Any]] = {}  # composite -> its runner, made once
    local, decide_call = router.local, router.decide
    # composite -> the C++ op that takes this overload's arguments as they are (Composite.redirect, with this
    # overload's name): the kernel calls it without Python, and for an in-place overload its in-place twin, or it
    # and a copy of its result into self (routing.cpp's call_redirect, as ``runner`` does). Not where the arguments
    # are adapted.
    redirects: dict[Callable[..., Any], str] = {}
    if adapt is None:
        redirects = {c.fn: target for c in router.table.composites.get(op.name, {}).values()
                     if c.redirect and (target := redirect_target(c.redirect, overload)) is not None}

    def decide(*args: Any, **kwargs: Any) -> Any:
        frame = local.frames[-1]  # the kernel calls only inside use()
        if frame.policy == "native":
            return PASS
        if eager_autograd and not records_autograd(args, kwargs):
            return PASS
        cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
        composite, native_runs, self_covers, _ = decide_call(op, frame, cargs, ckwargs, False)
        if inplace and not self_covers:
            raise InplaceRefusalError(inplace_message(packet))
        # the kind's entry says (registry.core.kinds); in place too where functorch batches it (batches_in_place)
        if native_runs[inplace] or (native_in_place and native_runs[False]):
            return NATIVE
        redirect = redirects.get(composite)
        if redirect is not None:
            return redirect
        run = runners.get(composite)
        if run is None:
            run = runners[composite] = runner(composite, overload)
        return run

    return decide


def _derivative_decider(router: PythonRouting, functional: Callable[..., Any], op: Op,
                        name: str) -> Callable[..., Any]:
    local, decide_call = router.local, router.decide
    # None: always the functional form under vmap
    of_op = cost.derivative_arguments(op.name, name, router.table.signatures, op.tensor_args)

    def decide(*args: Any, **kwargs: Any) -> Any:
        frame = local.frames[-1]
        if frame.policy == "native" or not vmap_active():
            return PASS
        # Where the op itself runs natively at these sizes (selection by cost), so does its derivative.
        if of_op is not None and decide_call(op, frame, (), of_op(args, kwargs), False)[1][0]:
            return PASS
        return functional

    return decide


def register(module: ModuleType, ops: list[Op], router: PythonRouting) -> None:
    """Register the C++ kernel of every overload of ``ops`` (and of their derivative ops)."""
    key = DISPATCH_KEY
    derivatives = router.table.derivatives
    for op in ops:
        for overload in op.overloads:
            native = torch.library.get_kernel(overload.qualified_name, key)
            slow = router.make_kernel(op, overload, native)
            module.register(overload.name, key, key, _decider(router, op, overload, eager_autograd=False), slow)
            if overload.name in op.eager_autograd:
                native = torch.library.get_kernel(overload.qualified_name, "AutogradCPU")
                slow = router.make_kernel(op, overload, native, eager_autograd=True)
                module.register(overload.name, "Autograd", "AutogradCPU",
                                _decider(router, op, overload, eager_autograd=True), slow)
        for name, functional in derivatives[op.name].items():
            native = torch.library.get_kernel(f"aten::{name}", key)
            slow = router.make_derivative_kernel(op.name, name, functional, native)
            module.register(name, key, key, _derivative_decider(router, functional, op, name), slow)
