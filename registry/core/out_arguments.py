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
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

DISPATCH_KEY = "FuncTorchDynamicLayerFrontMode"

# c10::ScalarType names, as PyTorch's cast check prints them.
_SCALAR_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}

_register_lock = threading.Lock()
_registered: list[bool] = []


def out_overloads() -> list[tuple[str, str]]:
    """Every aten overload with out arguments, as (op, overload name)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified.partition(".")
        schema = torch._C._get_schema(name, overload)
        if any(argument.is_out for argument in schema.arguments):
            found.append((name.removeprefix("aten::"), overload))
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


def _make_kernel(op: str, overload: str, native: Any, active: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed
    schema = getattr(getattr(torch.ops.aten, op), overload)._schema
    out_names = tuple(argument.name for argument in schema.arguments if argument.is_out)
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


def register(library: torch.library.Library, active: Callable[[], bool], taken: Iterable[str] = ()) -> None:
    """Register the kernel of every aten ``out=`` overload, once per process (about 30 ms for the 1100 of them);
    ``active()``: whether this thread is inside ``use()`` with a policy that routes, outside a composite; ``taken``:
    overloads (``name.overload``) that have a kernel of their own at the front key already."""
    with _register_lock:
        if _registered:
            return
        skip = set(taken)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for op, overload in out_overloads():
                name = f"{op}.{overload}"
                if name in skip:
                    continue
                native = torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY)
                library.impl(name, _make_kernel(op, overload, native, active), DISPATCH_KEY, with_keyset=True)
        _registered.append(True)
