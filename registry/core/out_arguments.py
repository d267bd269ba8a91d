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

Registering a kernel for each of the 1100 ``out=`` overloads costs about 50 ms, four times what a first call inside
``use()`` costs otherwise, and few programs pass ``out=``. So they are registered the first time PyTorch refuses an
``out=`` call inside ``use()`` (one of ``OUT_REFUSALS``): the transform that raised it (vmap, grad, vjp or jvp; jacrev,
jacfwd and hessian are made of those) sets the random number generator back and runs again, now with the kernels.
That once per process, Python side effects before the ``out=`` call happen twice.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
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
# (registering the kernels up front, which would avoid the question, costs every process 50 ms).
OUT_REFUSALS = ("the fallback path doesn't work on out= or view ops",
                "functions with out=... arguments don't support automatic differentiation",
                "because it is an out= function")
# The transforms whose refusal of an out= call registers the kernels and runs them again (vmap's is in
# registry.core.functionalization, which replaces vmap's implementation already).
RETRYING = ("grad_and_value_impl", "_vjp_with_argnums", "_jvp_with_argnums")

def out_overloads() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every aten overload with out arguments, as (op, overload name, the out arguments' names)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified.partition(".")
        outs = tuple(argument.name for argument in torch._C._get_schema(name, overload).arguments if argument.is_out)
        if outs:
            found.append((name.removeprefix("aten::"), overload, outs))
    return found


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


def _make_kernel(op: str, overload: str, out_names: tuple[str, ...], native: Any,
                 active: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed
    twin: list[torch._ops.OpOverload | None] = []  # looked up on the first call inside use()

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if not active():
            return call_native(keyset, *args, **kwargs)
        if not twin:
            twin.append(functional_twin(op, overload))
        functional = twin[0]
        if functional is None or any(name not in kwargs for name in out_names):
            return call_native(keyset, *args, **kwargs)
        outs = tuple(kwargs[name] for name in out_names)
        rest = {name: value for name, value in kwargs.items() if name not in out_names}
        result = functional(*args, **rest)
        results = result if isinstance(result, tuple) else (result,)
        for out, value in zip(outs, results, strict=True):
            write_into(out, value)
        return outs[0] if len(outs) == 1 else outs

    kernel.__name__ = f"multicomposite_out_{op}_{overload}"
    return kernel


def _retrying(transform: Callable[..., Any], patch: OutArguments) -> Callable[..., Any]:
    """``transform`` (grad's, vjp's or jvp's implementation) that, inside ``use()`` and until the kernels are
    registered, registers them where PyTorch refuses an out= call in it, and runs again from the same random state."""

    @functools.wraps(transform)
    def retrying(*args: Any, **kwargs: Any) -> Any:
        active = patch.active
        if patch.library is not None or torch.compiler.is_compiling() or active is None or not active():
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
    """``out=`` inside ``use()`` (``registry.core.patches.Patch``): ``install`` wraps grad's, vjp's and jvp's
    implementations so that PyTorch's first refusal of an ``out=`` call registers the kernels, into a Library of this
    patch's own, and runs again; ``uninstall`` unwraps them and destroys the Library."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        self.library: torch.library.Library | None = None  # the kernels, once registered

    def registered(self) -> bool:
        return self.library is not None

    def is_out_refusal(self, error: BaseException) -> bool:
        """Whether ``error`` is PyTorch refusing an out= call under a transform while the kernels are not
        registered."""
        return self.library is None and isinstance(error, (RuntimeError, NotImplementedError)) and any(
            refusal in str(error) for refusal in OUT_REFUSALS)

    def register_kernels(self) -> None:
        """Register the kernel of every aten ``out=`` overload without a kernel of its own at the front key (a
        covered op's routing kernel), once (about 50 ms for the 1100 of them)."""
        with self.lock:
            active = self.active
            if self.library is not None or active is None:
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
                setattr(eager_transforms, name, _retrying(getattr(eager_transforms, name), self))

    def uninstall(self) -> None:
        """grad's, vjp's and jvp's implementations are PyTorch's again, the kernels are gone, and they are registered
        anew after the next ``install()``."""
        with self.lock:
            if self.active is None:  # not installed: nothing of ours to unwrap (PyTorch's own may carry __wrapped__)
                return
            for name in RETRYING:
                patched = getattr(eager_transforms, name)
                setattr(eager_transforms, name, getattr(patched, "__wrapped__", patched))
            if self.library is not None:
                self.library._destroy()
                self.library = None
            self.active = None


PATCH = OutArguments()  # the default registry's (``Router.patches``)


def registered() -> bool:
    """Whether the default registry's ``out=`` kernels are registered."""
    return PATCH.registered()
