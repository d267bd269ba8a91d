"""Inside an automatically functionalized region: buffers made from outside tensors become functional too; inside a
batched-buffers region: buffers made at the level are batched.

``functionalize`` wraps the function's arguments and the tensors its factories make (``torch.zeros(5)``), but an op
whose only tensor input lives outside the region (a closure, a parameter read from its module, a module buffer) returns
a plain tensor: ``torch.empty_like(weight)``, ``weight.new_zeros(n)``, ``h0.clone()``. Writing a functional
(per-sample) value into that fresh buffer then fails inside functionalization ("mutating a non-functional tensor with
a functional tensor is not allowed"), though nothing outside the function is written. Here the buffer-making ops wrap
such an input as functionalize wraps an argument (read-only, as the region never writes it back unless it is
mutated), so the buffer they return is functional.

Functionalization also turns ``copy_`` into ``aten::copy``, which has no batching rule (vmap's per-sample loop); in a
region it is computed from ops that batch.

A batched-buffers region (``BatchedRegion``; NOTE [batched fresh buffers] in functionalization.py) is the cheaper
answer to the same write: every buffer the function makes at the vmap level (``torch.zeros``, ``ones``, ``empty``,
``full``, the ``*_like`` and ``new_*`` ops of a tensor vmap does not batch) is made batched, one copy of its value per
sample, so that writing per-sample values into it is an ordinary batched write. The values every sample sees are the
ones it would have seen unbatched.

The kernels are registered the first time a region opens (never, in a process that needs none) and do nothing
outside a region of their own thread. Where they are the compiled routing's, a batched-buffers region's buffers are
made in C++ by the same rule as ``_batched_buffer`` (``kernels/fresh_buffers.cpp``, NOTE [batched buffers in C++]),
without the GIL; the Python kernels serve functionalized regions and the Python routing backend.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    CVmapInterpreterPtr,
    TransformType,
    _add_batch_dim,
    _wrap_for_grad,
    _wrap_functional_tensor,
    get_interpreter_stack,
    maybe_current_level,
    maybe_get_level,
    peek_interpreter_stack,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)

from registry.core.context import DISPATCH_KEY, innermost, vmap_levels

# Ops that make a new tensor from one input's shape, dtype or values (the input is ``self``, the first argument).
BUFFER_MAKERS = ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
                 "new_full", "clone")
# Factories (no tensor input): a batched-buffers region batches what they make; a functionalized region leaves them to
# functionalize, which wraps them itself.
FACTORIES = ("zeros", "ones", "empty.memory_format", "full")
# The largest buffer a batched-buffers region batches, in elements over the batch (64 MiB of float32): a larger one is
# made as the function makes it, and a per-sample write into it sends the level to functionalization instead.
BATCHED_BUFFER_LIMIT = 1 << 24


@dataclass(frozen=True)
class Region:
    """An automatically functionalized region: its functionalize level and the vmap level it sits right inside."""

    functionalize_level: int
    vmap_level: int


class _Local(threading.local):
    regions: list[Region | BatchedRegion]
    busy = False  # inside a region kernel's own call: pass through

    def __init__(self) -> None:
        self.regions = []


@dataclass(frozen=True)
class BatchedRegion:
    """A batched-buffers region: the vmap level whose function's fresh buffers it batches."""

    vmap_level: int


def current_batched_region() -> BatchedRegion:
    """The region being entered: called first thing inside the vmap level (the innermost interpreter)."""
    return BatchedRegion(get_interpreter_stack()[-1].level())


@contextlib.contextmanager
def _below_every_level() -> Iterator[None]:
    """Every functorch level off the stack (ops run on ordinary tensors), then back in order."""
    saved = []
    while peek_interpreter_stack() is not None:
        saved.append(pop_dynamic_layer_stack())
    try:
        yield
    finally:
        for layer in reversed(saved):
            push_dynamic_layer_stack(layer)


_DIFFERENTIATING = (TransformType.Grad, TransformType.Jvp)


def _batched_buffer(overload: torch._ops.OpOverload, region: BatchedRegion, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The buffer ``overload`` makes, batched at the region's vmap level and every vmap level outside it (one copy
    of its value per sample), or None where it is not batched: a call functorch or a layer below makes (not the
    function's own, at or above the level), an input batched at some level (its own batching rule decides), a buffer
    that requires grad or one over ``BATCHED_BUFFER_LIMIT``, a grad or jvp level outside the region's vmap (what
    such a level would make of the buffer is left to functionalization), another transform on the stack."""
    level = maybe_current_level()
    if level is None or level < region.vmap_level or kwargs.get("requires_grad"):
        return None
    template = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if template is not None and vmap_levels(template):
        return None
    layers = [(interpreter.key(), interpreter.level(), interpreter) for interpreter in get_interpreter_stack()
              if interpreter.level() <= level]
    sizes = []
    for key, layer_level, interpreter in layers:
        if key == TransformType.Vmap and layer_level <= region.vmap_level:
            sizes.append(CVmapInterpreterPtr(interpreter).batchSize())
        elif key not in (TransformType.Vmap, *_DIFFERENTIATING) or layer_level < region.vmap_level:
            return None
    with _below_every_level():
        made = overload(*((innermost(template), *args[1:]) if template is not None else args), **kwargs)
        if made.numel() * math.prod(sizes) > BATCHED_BUFFER_LIMIT:
            return None
        made = made.expand(*sizes, *made.shape).clone()
    # Batched at each vmap level, outermost first; made inside each grad or jvp level between the region's vmap
    # and this call, as the function's own buffer would be: wrapped at each (a tensor a level did not wrap is one
    # captured from outside it, which it refuses to write).
    for key, layer_level, _ in layers:
        if key == TransformType.Vmap and layer_level <= region.vmap_level:
            made = _add_batch_dim(made, 0, layer_level)
        elif key in _DIFFERENTIATING:
            made = _wrap_for_grad(made, layer_level)
    return made


def current_region() -> Region:
    """The region being entered: called first thing inside ``functionalize``, the vmap level right outside it."""
    interpreters = get_interpreter_stack()
    return Region(interpreters[-1].level(), interpreters[-2].level())


def _called_inside(region: Region) -> bool:
    """Whether the call is the function's own, made inside the region (rather than one that functionalization, or a
    layer below it, makes on the way down: while a layer processes a call, the layers above it are off the stack)."""
    level = maybe_current_level()
    return level is not None and level >= region.functionalize_level


def _outside(tensor: Any, region: Region) -> bool:
    """Whether ``tensor`` was made outside the vmap the region sits in (a plain tensor, or one wrapped only at outer
    levels): levels grow inward, so every tensor made inside carries a level at least the vmap's."""
    return isinstance(tensor, torch.Tensor) and maybe_get_level(tensor) < region.vmap_level


def _make_buffer_maker(overload: torch._ops.OpOverload, native: Any, local: _Local) -> Any:
    call_native = native.call_boxed

    batchable = overload.__name__.split(".")[0] != "clone"  # a clone copies values: never batched

    def kernel(keyset: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        regions = local.regions
        if regions and isinstance(regions[-1], BatchedRegion):
            made = _batched_buffer(overload, regions[-1], (self, *args), kwargs) if batchable else None
            return call_native(keyset, self, *args, **kwargs) if made is None else made
        if regions and not local.busy and _called_inside(regions[-1]) and _outside(self, regions[-1]):
            functional = _wrap_functional_tensor(self, regions[-1].functionalize_level)
            local.busy = True
            try:
                return overload(functional, *args, **kwargs)
            finally:
                local.busy = False
        return call_native(keyset, self, *args, **kwargs)

    kernel.__name__ = f"multicomposite_region_{overload.__name__.replace('.', '_')}"
    return kernel


def _make_factory(overload: torch._ops.OpOverload, native: Any, local: _Local) -> Any:
    """A factory (``FACTORIES``): batched in a batched-buffers region, PyTorch's kernel elsewhere."""
    call_native = native.call_boxed

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        regions = local.regions
        if regions and isinstance(regions[-1], BatchedRegion):
            made = _batched_buffer(overload, regions[-1], args, kwargs)
            if made is not None:
                return made
        return call_native(keyset, *args, **kwargs)

    kernel.__name__ = f"multicomposite_region_{overload.__name__.replace('.', '_')}"
    return kernel


def _buffer_role(name: str) -> int:
    """How the C++ region kernel of ``name`` treats a call in a batched-buffers region (routing.cpp's BufferRole):
    1 a factory, 2 an op that takes a template tensor first, 0 never batched (clone, copy)."""
    if name in FACTORIES:
        return 1
    return 2 if name in BUFFER_MAKERS and name != "clone" else 0


def functional_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten::copy``: a new tensor of ``self``'s shape, dtype and device holding ``src`` broadcast to it."""
    return src.to(device=self.device, dtype=self.dtype, non_blocking=non_blocking).expand(self.shape).clone()


def _make_copy(native: Any, local: _Local) -> Any:
    """``aten::copy`` below a region (where functionalization sends ``copy_``): ``functional_copy``."""
    call_native = native.call_boxed

    def kernel(keyset: Any, self: Any, src: Any, non_blocking: bool = False) -> Any:
        regions = local.regions
        if regions and isinstance(regions[-1], Region) and not local.busy and not _called_inside(regions[-1]):
            local.busy = True
            try:
                return functional_copy(self, src, non_blocking)
            finally:
                local.busy = False
        return call_native(keyset, self, src, non_blocking)

    kernel.__name__ = "multicomposite_region_copy"
    return kernel


class FreshBuffers:
    """The region kernels and each thread's open regions (``registry.core.patches.Patch``, and ``CompiledKernels``:
    on the C++ backend the kernels go into the compiled routing's Library behind a C++ gate). They are registered at
    the first region (``register``): into the compiled routing's Library where it is loaded (until it is destroyed,
    ``compiled_dropped``), else into a Library of their own that ``uninstall`` destroys.

    NOTE [region kernels behind a gate]: once registered, the kernels sit at the front key of every buffer-making op
    for every transform in the process, inside ``use()`` and outside it. As Python kernels they cost each call at
    each level a Python call even where no region is open: a ``clone`` under ``vmap(grad)`` 7.2 us instead of 3.1, a
    ``ones_like`` 9.1 instead of 2.8 (measured, one thread). The C++ backend's kernel (``routing.cpp``'s
    ``RegionKernel``) calls them only while a region is open on the calling thread (``set_open_regions``)."""

    def __init__(self) -> None:
        self.local = _Local()
        self.lock = threading.Lock()
        self.library: torch.library.Library | None = None  # the Python kernels' Library (no compiled routing)
        self.compiled: ModuleType | None = None  # the compiled routing, while its Library exists
        self.compiled_registered = False  # the kernels are in the compiled routing's Library
        # Where the kernels are the compiled routing's, a batched-buffers region's buffers are made in C++; False:
        # by the Python kernels (a test's way to reach them, and the same rule).
        self.buffers_in_cpp = True

    def push(self, region: Region | BatchedRegion) -> None:
        self.local.regions.append(region)
        self._count_regions()

    def pop(self) -> None:
        self.local.regions.pop()
        self._count_regions()

    def _count_regions(self) -> None:
        compiled = self.compiled
        if compiled is not None:
            regions = self.local.regions
            # A batched-buffers region's buffers are made in C++ where its kernels are there (NOTE [batched buffers
            # in C++] in kernels/fresh_buffers.cpp); -1: the Python kernels decide.
            batched = (regions[-1].vmap_level if regions and isinstance(regions[-1], BatchedRegion)
                       and self.compiled_registered and self.buffers_in_cpp else -1)
            compiled.set_open_regions(len(regions), batched, BATCHED_BUFFER_LIMIT)

    def install(self, active: Callable[[], bool]) -> None:
        """Nothing until the first region: a process that needs none registers nothing."""

    def register_compiled(self, module: ModuleType) -> None:
        """Keep the compiled routing: the first region registers the kernels into its Library."""
        with self.lock:
            self.compiled = module
        self._count_regions()

    def compiled_dropped(self) -> None:
        """The compiled routing's Library, and the kernels in it, are gone: the next region registers them again."""
        with self.lock:
            self.compiled = None
            self.compiled_registered = False

    def register(self) -> None:
        """Register the region kernels, once (until ``uninstall`` or the compiled routing's Library goes)."""
        if self.library is not None or self.compiled_registered:
            return
        with self.lock:
            if self.library is not None or self.compiled_registered:
                return
            kernels = {name: _make_buffer_maker(getattr(torch.ops.aten, name).default,
                                                torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY), self.local)
                       for name in BUFFER_MAKERS}
            kernels["copy"] = _make_copy(torch.library.get_kernel("aten::copy", DISPATCH_KEY), self.local)
            for name in FACTORIES:
                packet, _, overload_name = name.partition(".")
                kernels[name] = _make_factory(getattr(getattr(torch.ops.aten, packet), overload_name or "default"),
                                              torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY), self.local)
            if self.compiled is not None:
                for name, kernel in kernels.items():
                    self.compiled.register_region_kernel(name, kernel, _buffer_role(name))
                self.compiled_registered = True
                self._count_regions()  # a region already open on this thread: its C++ state
                return
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Warning only once for all operators")
                for name, kernel in kernels.items():
                    library.impl(name, kernel, DISPATCH_KEY, with_keyset=True)
            self.library = library  # kept alive: dropping the Library unregisters its kernels

    def uninstall(self) -> None:
        """Remove the Python region kernels; the next retry that needs them registers them again (the compiled ones
        go with the compiled routing's Library, which the router destroys)."""
        with self.lock:
            if self.library is not None:
                self.library._destroy()
                self.library = None


PATCH = FreshBuffers()  # the default registry's (``Router.patches``)
