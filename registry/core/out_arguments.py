"""``out=`` arguments inside ``use()`` under a transform: the op computed out of place, then copied into ``out``.

PyTorch's ``out=`` overloads have neither batching rules ("Batching rule not implemented for aten::mul.out; the
fallback path doesn't work on out= or view ops") nor derivatives ("functions with out=... arguments don't support
automatic differentiation"), so ``torch.mul(a, b, out=buf)`` fails under vmap, grad, jacrev, jacfwd and hessian.
Inside ``use()``, while a transform is active, each ``out=`` overload runs as its functional twin (the overload of the
same op with the same arguments but ``out``) and the result is written into ``out`` as PyTorch's ``out=`` does:
refused where the result's dtype cannot be cast to out's, out resized where its shape differs (with PyTorch's
warning where it held elements), then ``out.copy_(result)``. That copy is an ordinary in-place write: into a buffer
made inside the function it is functionalized like any other (registry.core.functionalization), and into a tensor
from outside the function it gets the error that names it.

The kernels sit at the functorch front key (never reached outside a transform); outside ``use()``, with policy
``native``, inside a composite, or for an overload without a functional twin, PyTorch's own kernel runs.

Where the C++ routing kernels route (``registry.core.kernels``), the ``out=`` kernels are C++ too, registered with
the routing kernels into their Library when they are (``routing.cpp``'s ``register_out``: 1,107 overloads in about
8 ms): outside ``use()`` or inside a composite each passes to PyTorch's kernel without the GIL, and the Python part
below is made for an overload at its first call inside ``use()``. No transform retries there, so grad's and vjp's
implementations stay PyTorch's own (``UNWRAPPED_WHEN_COMPILED``).

With the Python routing kernels, registering a kernel for each of the 1,100 overloads from Python costs 120-170 ms,
ten times what a first call inside ``use()`` costs otherwise, and few programs pass ``out=``. So there they are
registered the first time PyTorch refuses an ``out=`` call inside ``use()`` (one of ``OUT_REFUSALS``): the transform
that raised it (vmap, grad, vjp or jvp; jacrev, jacfwd and hessian are made of those) sets the random number
generator back and runs again, now with the kernels. That once per process, Python side effects before the ``out=``
call happen twice.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - functorch's internals have no public API

from registry.core import random_state
from registry.core.context import DISPATCH_KEY

# c10::ScalarType names, as PyTorch's cast check prints them.
_SCALAR_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}

# What PyTorch says when an out= call meets a transform: vmap's, autograd's and forward AD's refusals. Recognised by
# their text because nothing else tells them apart: each is a plain RuntimeError (or NotImplementedError) raised in
# C++ from inside the user's function, and no probe can say before the call whether the function passes out= at all
# (registering the Python kernels up front, which would avoid the question, costs every process 120-170 ms; the C++
# backend registers its own up front).
OUT_REFUSALS = ("the fallback path doesn't work on out= or view ops",
                "functions with out=... arguments don't support automatic differentiation",
                "because it is an out= function")
# The transforms whose refusal of an out= call registers the kernels and runs them again (vmap's is in
# registry.core.functionalization, which replaces vmap's implementation already).
RETRYING = ("grad_and_value_impl", "_vjp_with_argnums", "_jvp_with_argnums")
# Where the compiled out= kernels are registered no transform retries, and these wrappers are taken out again (they
# cost a Python frame on every call). jvp's stays, passing straight through: inplace_under_jvp wraps it after this
# patch, so ours is not the outermost and cannot be taken out or put back alone.
UNWRAPPED_WHEN_COMPILED = ("grad_and_value_impl", "_vjp_with_argnums")

def out_overloads() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every aten overload with out arguments, as (op, overload name, the out arguments' names)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified.partition(".")
        outs = _out_names(torch._C._get_schema(name, overload))
        if outs:
            found.append((name.removeprefix("aten::"), overload, outs))
    return found


def _out_names(schema: torch._C.FunctionSchema) -> tuple[str, ...]:
    return tuple(argument.name for argument in schema.arguments if argument.is_out)


def _signature(schema: torch._C.FunctionSchema) -> tuple[tuple[str, str], ...]:
    return tuple((argument.name, str(argument.type)) for argument in schema.arguments if not argument.is_out)


def functional_twin(op: str, overload: str) -> torch._ops.OpOverload | None:
    """The overload of ``op`` with the arguments of ``op.overload`` but its out ones, and as many results as it
    has out arguments; None where there is none (``aten::_foreach_add.List_out``, the ``*_backward`` outs)."""
    packet = getattr(torch.ops.aten, op)
    schema = getattr(packet, overload)._schema
    outs = sum(argument.is_out for argument in schema.arguments)
    wanted = _signature(schema)
    for name in packet.overloads():
        candidate = getattr(packet, name)._schema
        if (not any(argument.is_out for argument in candidate.arguments) and not candidate.is_mutable
                and len(candidate.returns) == outs and _signature(candidate) == wanted):
            return getattr(packet, name)
    return None


def write_into(out: torch.Tensor, result: torch.Tensor) -> None:
    """What an ``out=`` overload does with its result: the cast check, the resize (warning where out held elements),
    the copy."""
    if not torch.can_cast(result.dtype, out.dtype):
        raise RuntimeError(f"result type {_SCALAR_TYPE_NAMES.get(result.dtype, result.dtype)} can't be cast to the "
                           f"desired output type {_SCALAR_TYPE_NAMES.get(out.dtype, out.dtype)}")
    if out.shape != result.shape:
        if out.numel():
            warnings.warn(f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
                          f"which does not match the required output shape {list(result.shape)}. This behavior is "
                          "deprecated, and in a future PyTorch release outputs will not be resized unless they have "
                          "zero elements. You can explicitly reuse an out tensor t by resizing it, inplace, to zero "
                          "elements with t.resize_(0).", UserWarning, stacklevel=4)
        out.resize_(result.shape)
    out.copy_(result)


def _out_kernel(op: str, overload: str, out_names: tuple[str, ...],
                routes: Callable[[], bool]) -> Callable[..., Any]:
    """``(*args, **kwargs)``: the ``out=`` call computed by its functional twin and written into its out arguments,
    or NotImplemented where PyTorch's own kernel runs (not routing here, no functional twin, out not given)."""
    twin: list[torch._ops.OpOverload | None] = []  # looked up on the first call inside use()

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not routes():
            return NotImplemented
        if not twin:
            twin.append(functional_twin(op, overload))
        functional = twin[0]
        if functional is None or any(name not in kwargs for name in out_names):
            return NotImplemented
        outs = tuple(kwargs[name] for name in out_names)
        rest = {name: value for name, value in kwargs.items() if name not in out_names}
        result = functional(*args, **rest)
        results = result if isinstance(result, tuple) else (result,)
        for out, value in zip(outs, results, strict=True):
            write_into(out, value)
        return outs[0] if len(outs) == 1 else outs

    kernel.__name__ = f"multicomposite_out_{op}_{overload}"
    return kernel


def _make_kernel(op: str, overload: str, out_names: tuple[str, ...], native: Any,
                 active: Callable[[], bool]) -> Callable[..., Any]:
    """The Python backend's kernel (``torch.library`` passes the keyset first): ``_out_kernel``, else PyTorch's."""
    call_native = native.call_boxed
    compute = _out_kernel(op, overload, out_names, active)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        result = compute(*args, **kwargs)
        return call_native(keyset, *args, **kwargs) if result is NotImplemented else result

    kernel.__name__ = compute.__name__
    return kernel


def _retrying(transform: Callable[..., Any], patch: OutArguments) -> Callable[..., Any]:
    """``transform`` (grad's, vjp's or jvp's implementation) that, inside ``use()`` and until the kernels are
    registered, registers them where PyTorch refuses an out= call in it, and runs again from the same random state."""

    @functools.wraps(transform)
    def retrying(*args: Any, **kwargs: Any) -> Any:
        active = patch.active
        if patch.registered() or torch.compiler.is_compiling() or active is None or not active():
            return transform(*args, **kwargs)
        state = random_state.save()
        try:
            return transform(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            if not patch.is_out_refusal(error):
                raise
        patch.register_kernels()
        random_state.restore(state)
        return transform(*args, **kwargs)

    return retrying


class OutArguments:
    """``out=`` inside ``use()`` (``registry.core.patches.Patch``, and ``CompiledKernels`` on the C++ backend):
    ``install`` wraps grad's, vjp's and jvp's implementations so that, while the kernels are not registered, PyTorch's
    first refusal of an ``out=`` call registers them, into a Library of this patch's own, and runs again;
    ``uninstall`` unwraps them and destroys the Library. On the C++ backend the router registers the compiled kernels
    with its routing kernels (``register_compiled``), and the wrappers pass straight through."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        self.library: torch.library.Library | None = None  # the Python kernels, once registered
        # The C++ kernels are in the C++ routing's Library (register_compiled), until it is destroyed (compiled_dropped)
        self.compiled_registered = False
        self.originals: dict[str, Callable[..., Any]] = {}  # name in RETRYING -> what our wrapper wraps, installed
        self.wrappers: dict[str, Callable[..., Any]] = {}  # name in RETRYING -> our wrapper, installed

    def registered(self) -> bool:
        """Whether the ``out=`` kernels are registered: the Python ones, or the C++ ones (which go with the C++
        routing kernels, on a switch to the Python backend)."""
        return self.library is not None or self.compiled_registered

    def is_out_refusal(self, error: BaseException) -> bool:
        """Whether ``error`` is PyTorch refusing an out= call under a transform while the kernels are not
        registered."""
        return isinstance(error, (RuntimeError, NotImplementedError)) and not self.registered() and any(
            refusal in str(error) for refusal in OUT_REFUSALS)

    def routes(self) -> bool:
        """Whether this thread routes (False while not installed)."""
        active = self.active
        return active is not None and active()

    def compiled_kernel(self, name: str) -> Callable[..., Any]:
        """The Python part of the C++ ``out=`` kernel of ``aten::<name>`` ("mul.out"), which the C++ kernel makes at
        the overload's first call inside ``use()``."""
        op, _, overload = name.partition(".")
        return _out_kernel(op, overload, _out_names(torch._C._get_schema(f"aten::{op}", overload)), self.routes)

    def register_compiled(self, module: ModuleType) -> None:
        """Register the C++ ``out=`` kernels into the C++ routing's Library (after its routing kernels, which keep
        the overloads they route), once per Library; grad's and vjp's wrappers come out."""
        with self.lock:
            if not module.out_registered():
                module.register_out(self.compiled_kernel)
            self.compiled_registered = True
            self._wrap(UNWRAPPED_WHEN_COMPILED, wrapped=False)

    def compiled_dropped(self) -> None:
        """The C++ routing's Library is gone (a switch to the Python backend): the wrappers retry again."""
        with self.lock:
            self.compiled_registered = False
            self._wrap(UNWRAPPED_WHEN_COMPILED, wrapped=True)

    def _wrap(self, names: tuple[str, ...], *, wrapped: bool) -> None:
        """Put our wrapper of each of ``names`` in place (or take it out) where the attribute is what we left there,
        while installed."""
        for name in names:
            if name not in self.wrappers:
                continue
            wrapper, original = self.wrappers[name], self.originals[name]
            current = getattr(eager_transforms, name)
            if wrapped and current is original:
                setattr(eager_transforms, name, wrapper)
            elif not wrapped and current is wrapper:
                setattr(eager_transforms, name, original)

    def register_kernels(self) -> None:
        """Register the Python kernel of every aten ``out=`` overload without a kernel of its own at the front key (a
        covered op's routing kernel), once (120-170 ms for the 1,100 of them)."""
        with self.lock:
            active = self.active
            if self.registered() or active is None:
                return
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Warning only once for all operators")
                for op, overload, outs in out_overloads():
                    name = f"{op}.{overload}"
                    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", DISPATCH_KEY):
                        continue  # routed already: asked of the dispatcher, which knows every Library's kernels
                    native = torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY)
                    library.impl(name, _make_kernel(op, overload, outs, native, active), DISPATCH_KEY,
                                 with_keyset=True)
            self.library = library

    def install(self, active: Callable[[], bool]) -> None:
        """``active()``: whether this thread is inside ``use()`` with a policy that routes, outside a composite."""
        with self.lock:
            if self.active is not None:
                return
            self.active = active
            for name in RETRYING:
                original = self.originals[name] = getattr(eager_transforms, name)
                wrapper = self.wrappers[name] = _retrying(original, self)
                setattr(eager_transforms, name, wrapper)
            if self.compiled_registered:
                self._wrap(UNWRAPPED_WHEN_COMPILED, wrapped=False)

    def uninstall(self) -> None:
        """grad's, vjp's and jvp's implementations are PyTorch's again, the kernels are gone, and they are registered
        anew after the next ``install()``."""
        with self.lock:
            if self.active is None:  # not installed: nothing of ours to unwrap
                return
            self._wrap(RETRYING, wrapped=False)  # those after us in the patch order are unwrapped already
            self.wrappers.clear()
            self.originals.clear()
            if self.library is not None:
                self.library._destroy()
                self.library = None
            self.active = None


PATCH = OutArguments()  # the default registry's (``Router.patches``)


def registered() -> bool:
    """Whether the default registry's ``out=`` kernels are registered."""
    return PATCH.registered()
