"""In-place overloads routed only where forward-mode AD is on the stack.

Some in-place overloads batch in PyTorch (a native decision can run them as they are) while their forward-AD formula
disagrees with their backward: ``index_put_`` without accumulate at repeated indices (``out[idx] += v``) gives only
the landing position's values a tangent, its backward every repeated position's values the gradient. Routed like
every covered in-place overload, each call would be computed out of place and copied back even where the decision is
native (measured: ``out[idx] = v`` under vmap(grad) 1.2-1.5x slower). Declared here instead, such an overload runs
PyTorch's own in-place kernel unless, inside ``use()``, a jvp level is on the functorch stack: there it is computed
by its out-of-place overload (a covered op, routed by the selector) and written into self with ``copy_`` (an
in-place write like any other: functionalized where self is a fresh buffer).

A Python kernel at the front key costs every call of the overload under any transform (measured: ``out[idx] = v``
under vmap(grad), 410-480 us, about 60 us more with the kernel), so the kernels are registered the first time a jvp
level is entered inside ``use()`` (torch.func's jvp, which jacfwd and hessian are made of): a process that never runs
forward-mode AD inside ``use()`` never pays for them.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - functorch's internals have no public API

from registry.core.context import DISPATCH_KEY, functorch_stack


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _make_kernel(functional: torch._ops.OpOverload, native: Any, active: Callable[[], bool]) -> Callable[..., Any]:
    call_native = native.call_boxed

    def kernel(keyset: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        if active() and any(transform == "jvp" for transform, _ in functorch_stack()):
            return self.copy_(functional(self, *args, **kwargs))
        return call_native(keyset, self, *args, **kwargs)

    kernel.__name__ = f"multicomposite_under_jvp_{functional.__name__.replace('.', '_')}"
    return kernel


def _registering(transform: Callable[..., Any], patch: InplaceUnderJvp) -> Callable[..., Any]:
    """jvp's implementation, registering the kernels first where it runs inside ``use()`` for the first time."""

    @functools.wraps(transform)
    def registering(*args: Any, **kwargs: Any) -> Any:
        active = patch.active
        if (len(patch.registered) != len(patch.declared) and active is not None and not torch.compiler.is_compiling()
                and active()):
            patch.register_kernels()
        return transform(*args, **kwargs)

    return registering


class InplaceUnderJvp:
    """The declared overloads and their kernels (``registry.core.patches.Patch``): ``install`` wraps jvp's
    implementation so that its first run inside ``use()`` registers the kernels, into a Library of this patch's own;
    ``uninstall`` unwraps it and destroys the Library."""

    def __init__(self) -> None:
        # in-place overload ("index_put_") -> the out-of-place overload ("index_put") it is computed as under jvp.
        self.declared: dict[str, str] = {}
        self.registered: set[str] = set()
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        self.library: torch.library.Library | None = None

    def declare(self, inplace: str, functional: str) -> None:
        """Route ``aten::<inplace>`` through ``aten::<functional>`` (then ``copy_``) where a jvp level is active."""
        self.declared[inplace] = functional

    def register_kernels(self) -> None:
        """Register the kernel of every declared overload not registered yet."""
        with self.lock, warnings.catch_warnings():
            active = self.active
            if active is None:
                return
            if self.library is None:
                self.library = torch.library.Library("aten", "IMPL")
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for inplace, functional in self.declared.items():
                if inplace in self.registered:
                    continue
                native = torch.library.get_kernel(f"aten::{inplace}", DISPATCH_KEY)
                self.library.impl(inplace, _make_kernel(_overload(functional), native, active), DISPATCH_KEY,
                                  with_keyset=True)
                self.registered.add(inplace)

    def install(self, active: Callable[[], bool]) -> None:
        """``active()``: whether this thread is inside ``use()`` with a policy that routes, outside a composite."""
        with self.lock:
            if self.active is not None:
                return
            self.active = active
            eager_transforms._jvp_with_argnums = _registering(eager_transforms._jvp_with_argnums, self)

    def uninstall(self) -> None:
        """jvp's implementation is the one it wrapped again, the kernels are gone, and they are registered anew at
        the first jvp after the next ``install()``."""
        with self.lock:
            if self.active is None:
                return
            patched = eager_transforms._jvp_with_argnums
            eager_transforms._jvp_with_argnums = getattr(patched, "__wrapped__", patched)
            if self.library is not None:
                self.library._destroy()
                self.library = None
            self.registered.clear()
            self.active = None


PATCH = InplaceUnderJvp()  # the default registry's (``Router.patches``)


def declare(inplace: str, functional: str) -> None:
    """Route ``aten::<inplace>`` through ``aten::<functional>`` (then ``copy_``) where a jvp level is active (the
    default registry's patch)."""
    PATCH.declare(inplace, functional)
