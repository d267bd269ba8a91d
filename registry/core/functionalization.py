"""Automatic functionalization inside ``use()``: in-place writes of batched values into fresh, unbatched buffers.

Model code writes per-sample results into buffers it has just made (``torch.empty_like(y).copy_(y)``,
``src.new_zeros(n, f).scatter_add_(0, index, src)``, ``out.index_add_(0, index, msg)``, ``buf[idx] = v``). Under
vmap the buffer is unbatched and the value batched, and vmap refuses: "vmap: index_add_(self, *extra_args) is not
possible because there exists a Tensor `other` in extra_args that has more elements than `self`". Written as
``vmap(functionalize(f))`` the same code runs: functionalization replaces each in-place write by its out-of-place
form, so the buffer becomes a new (batched) tensor instead of being written into.

Inside ``use()``, vmap's implementation (``torch._functorch.vmap._flat_vmap``, which every entry point reaches:
``torch.vmap``, ``torch.func.vmap`` however imported, ``jacrev``, ``jacfwd``, ``hessian``) runs the function as it
is; when that refusal comes out of it, the random number generators are set back to where they were and the same
level runs again, first with the function's fresh buffers made batched (NOTE [batched fresh buffers]), and where
that fails as ``functionalize(func)`` (vmap outside, everything the function does inside: ``vmap(grad(f))`` runs as
``vmap(functionalize(grad(f)))``). The function is remembered by its code, so its later calls run
functionalized from the start. Where the retry fails too, the write was into a tensor that lives outside the
transform (a closure, a parameter, a module buffer, an argument vmap does not batch): per-sample values cannot go
into one shared tensor, and the error names that tensor, the user's line, and what to write instead.

Where the samples of the level disagree on a Python branch or a shape (``SamplesDisagreeError``), the same place
re-runs the level once per group of agreeing samples (registry.core.batch_split). vmap's refusal of boolean-mask
indexing comes out here too: the first time, the kernel that computes it per sample is registered and the level runs
again; a write through a batched mask is raised again with the user's line (registry.core.control_flow).

Outside ``use()`` (or with policy ``native``), vmap runs exactly as PyTorch's. See docs/functionalization.md.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.vmap as functorch_vmap  # noqa: PLC2701 - functorch's internals have no public API
from torch._functorch.eager_transforms import functionalize  # noqa: PLC2701 - functorch's internals have no public API

from registry.core import (
    batch_split,
    control_flow,
    fresh_buffers,
    mask_indexing,
    out_arguments,
    random_state,
    transform_calls,
    write_target,
)
from registry.core.context import functorch_stack
from registry.core.disagree import SamplesDisagreeError
from registry.core.frames import raising_user_frame
from registry.core.runners import InplaceRefusalError

# PyTorch's refusal of an in-place write of a batched value into an unbatched self (every in-place op's batching rule
# says it; the routing kernels' in-place variants raise ``InplaceRefusalError`` with the same text, recognised by type).
# PyTorch's own is a plain RuntimeError raised in C++ from inside the user's function, where no probe can run before
# the write (vmap runs the function whole; only a kernel on every in-place overload could look at its arguments, and
# that would cost every in-place call under every transform): so it, and the three below, are recognised by text.
INPLACE_REFUSAL = ("is not possible because there exists a Tensor `other` in extra_args that has more elements than "
                   "`self`")
# The same refusal from in-place arithmetic (``buffer.add_(batched)``): the broadcast shape includes the batch.
BROADCAST_REFUSAL = "doesn't match the broadcast shape"
# Functionalization's refusal of the same write where self lives outside the functionalized function.
OUTSIDE_REFUSAL = "mutating a non-functional tensor with a functional tensor is not allowed"
# grad's refusal of a write into a tensor captured from outside it (the write, functionalized, reaches grad as copy_).
CAPTURED_REFUSAL = "that would mutate a captured Tensor"


class OutsideWriteError(RuntimeError):
    """An in-place write of per-sample values into a tensor that lives outside the transformed function.

    Its message keeps PyTorch's refusal text, so an enclosing vmap level (which may own the buffer) still recognizes
    it and tries functionalizing there."""


PYTORCH_FLAT_VMAP = transform_calls.PYTORCH_FLAT_VMAP  # functorch's own, captured once


def function_key(func: Callable[..., Any]) -> tuple[object, ...]:
    """What identifies a vmapped function across calls: its code and the code of the functions it wraps.

    ``grad(f)`` and ``jacfwd``'s inner function are closures of torch.func shared by every user: the wrapped function
    (``__wrapped__``, closure cells, ``functools.partial``) tells them apart. A module stands for its class; a
    builtin, a method of a C type (``torch.Tensor.zero_``) or a torch op for itself.
    """
    found: list[object] = []
    seen: set[int] = set()

    def visit(obj: object, depth: int) -> None:
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            return
        if isinstance(obj, types.MethodType):
            visit(obj.__func__, depth)
            return
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            found.append(code)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(content) and not isinstance(content, type):
                    visit(content, depth + 1)
        elif isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                              types.MethodWrapperType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            # One wrapper around many ops (``lambda *a: op(*a)``) is as many functions: one that writes into a fresh
            # buffer must not have the others functionalized too.
            found.append(obj)
        elif callable(obj):
            found.append(type(obj))
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            visit(wrapped, depth + 1)

    visit(func, 0)
    return tuple(found)


def _restore_random_state(saved: random_state.Saved | None) -> None:
    if saved is not None:  # None: randomness="error", where nothing random could run
        random_state.restore(saved)


def _is_write_refusal(error: BaseException) -> bool:
    if isinstance(error, (OutsideWriteError, InplaceRefusalError)):  # ours: the routing kernels' and the retry's
        return True
    return isinstance(error, RuntimeError) and INPLACE_REFUSAL in str(error)  # PyTorch's (see INPLACE_REFUSAL)


def _may_be_write_refusal(error: BaseException) -> bool:
    """The refusal, or in-place arithmetic's shape error (which a true shape mismatch also raises: its retry fails
    the same way and that error is raised unchanged)."""
    return _is_write_refusal(error) or BROADCAST_REFUSAL in str(error)


def _functionalization_failed(error: BaseException) -> bool:
    """Whether ``error`` says that this write cannot be functionalized here (rather than that the function failed):
    the write refusal again, functionalization's own refusal, or an internal limit of functionalize."""
    text = str(error)
    return _is_write_refusal(error) or OUTSIDE_REFUSAL in text or CAPTURED_REFUSAL in text or "unctionaliz" in text


def _outside_write_message(failure: BaseException, retry: BaseException) -> str:
    frame = raising_user_frame(failure.__traceback__) or raising_user_frame(retry.__traceback__)
    target = write_target.describe(frame) if frame is not None else None
    where = f" at {frame.describe()}" if frame is not None else ""
    what = target or "a tensor made outside the vmapped function"
    if isinstance(failure, OutsideWriteError):
        return str(failure)
    retry_line = str(retry).splitlines()[0] if str(retry) else type(retry).__name__
    why = ("it lives outside the transformed function (a closure, a parameter, a module buffer, or an argument vmap "
           "does not batch), so one tensor would have to hold a different value per sample"
           if OUTSIDE_REFUSAL in str(retry) or CAPTURED_REFUSAL in str(retry) or _is_write_refusal(retry)
           else f"running the function functionalized failed too ({retry_line})")
    return (f"vmap: an in-place write{where} puts per-sample values into {what}, which is not batched; {why}. "
            "Write the out-of-place form and use its result instead (buf = buf.index_add(0, idx, v), "
            "buf = buf.scatter_add(0, idx, v), buf = buf.index_put((idx,), v), buf = torch.where(mask, v, buf), "
            "buf = v.expand_as(buf).clone() for copy_), or make the buffer inside the function (torch.zeros(...), "
            "v.new_zeros(...)) and return what must leave it. PyTorch's refusal: "
            f"{str(failure).splitlines()[0]} ({INPLACE_REFUSAL})")


class Functionalization:
    """Automatic functionalization inside ``use()`` (``registry.core.patches.Patch``): ``install`` puts
    ``flat_vmap`` in place of functorch's ``_flat_vmap``, ``uninstall`` puts PyTorch's back and forgets what was
    remembered. It holds the predicate (whether this thread routes), the functions remembered as needing
    functionalization, and the patches its retries use: the fresh-buffer regions, the ``out=`` kernels and the
    boolean-mask kernel."""

    def __init__(self, fresh: fresh_buffers.FreshBuffers, outs: out_arguments.OutArguments,
                 masks: mask_indexing.MaskIndexing, levels: transform_calls.TransformCalls) -> None:
        self.fresh_buffers = fresh
        self.out_arguments = outs
        self.mask_indexing = masks
        self.levels = levels  # runs a level as functorch's _flat_vmap does (transform_calls.py: NOTE [transform calls])
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        # Code of the functions (with the code of what they wrap) whose vmapped body needed functionalizing.
        self.functionalized: set[tuple[object, ...]] = set()
        # Of those, the ones that ran with their fresh buffers batched instead (NOTE [batched fresh buffers]).
        self.batched_buffers: set[tuple[object, ...]] = set()

    def install(self, active: Callable[[], bool]) -> None:
        """Threads outside ``use()`` (``active()`` false) run PyTorch's own implementation."""
        with self.lock:
            self.active = active
            functorch_vmap._flat_vmap = self.flat_vmap

    def uninstall(self) -> None:
        with self.lock:
            functorch_vmap._flat_vmap = PYTORCH_FLAT_VMAP
            self.active = None
            self.functionalized.clear()
            self.batched_buffers.clear()

    @contextlib.contextmanager
    def remembering_apart(self) -> Iterator[None]:
        """Within the block, no function is remembered as needing functionalization, and nothing remembered there
        outlives it: the harness runs each case as a program of its own (its wrappers share their code across ops,
        so one case's write into a fresh buffer would have the next op's case functionalized too)."""
        remembered = (self.functionalized, self.batched_buffers)
        saved = [set(keys) for keys in remembered]
        for keys in remembered:
            keys.clear()
        try:
            yield
        finally:
            for keys, kept in zip(remembered, saved, strict=True):
                keys.clear()
                keys.update(kept)

    def functionalizing(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``functionalize(func)``, with the region kept on this thread's stack while it runs (fresh_buffers reads
        it)."""
        return functionalize(self._in_region(func, fresh_buffers.current_region))

    def _in_region(self, func: Callable[..., Any],
                   region: Callable[[], fresh_buffers.Region | fresh_buffers.BatchedRegion]) -> Callable[..., Any]:
        """``func`` with the region ``region()`` finds on entry kept on this thread's stack while it runs."""
        fresh = self.fresh_buffers
        # Registered here, not only at the first retry: a function remembered as needing a region runs in one from the
        # start, and the kernels may have gone since (the C++ ones go with the compiled routing's Library).
        fresh.register()

        @functools.wraps(func)
        def in_region(*args: Any, **kwargs: Any) -> Any:
            fresh.push(region())
            try:
                return func(*args, **kwargs)
            finally:
                fresh.pop()

        return in_region

    def batching_buffers(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` with a batched-buffers region kept on this thread's stack while it runs inside the vmap level.

        NOTE [batched fresh buffers]: functionalizing the level makes every op of it, forward and backward, pass
        through the functionalize layer: the graph network of bench.models (a GCN layer whose degree and aggregation
        are scatters into ``torch.zeros`` and ``new_zeros`` buffers) ran its per-sample-gradient step at batch 4 in
        2.13 ms functionalized, against 1.19 ms with those buffers made batched by hand (measured, one thread). So the
        first retry runs the level with the function's fresh buffers batched (fresh_buffers.BatchedRegion: one copy
        of each buffer's value per sample, so every sample computes with the values it would have had), and the
        write is an ordinary batched one. Where that run fails in any way (a buffer written into a tensor from outside,
        returned where out_dims says it is not batched, too large to batch), the level runs functionalized, as
        before."""
        return self._in_region(func, fresh_buffers.current_batched_region)

    def flat_vmap(self, func: Callable[..., Any], batch_size: int, flat_in_dims: list[int | None],
                  flat_args: list[Any], args_spec: Any, out_dims: Any, randomness: str, **kwargs: Any) -> Any:
        """vmap's implementation, functionalizing the level where an in-place write into a fresh buffer needs it."""
        args = (batch_size, flat_in_dims, flat_args, args_spec, out_dims, randomness)
        active = self.active
        if torch.compiler.is_compiling() or active is None or not active():
            # Dynamo traces vmap's Python (it cannot trace a retry); outside use(): PyTorch's vmap.
            return PYTORCH_FLAT_VMAP(func, *args, **kwargs)
        # The key is computed only where something is remembered or a run failed (about 5 us); the random state is saved
        # only where a random op can run: in randomness="error" mode vmap refuses every one (random_state.py: its cost).
        functionalized = self.functionalized
        key = function_key(func) if functionalized else None
        remembered = key is not None and key in functionalized
        batched = remembered and key in self.batched_buffers
        state = None if randomness == "error" else random_state.save()
        try:
            if batched:
                return self.levels.flat_vmap(self.batching_buffers(func), *args, **kwargs)
            if remembered:
                return self.levels.flat_vmap(self.functionalizing(func), *args, **kwargs)
            return self.levels.flat_vmap(func, *args, **kwargs)
        except SamplesDisagreeError as error:
            return self.split(error, state, func, *args, **kwargs)
        except RuntimeError as error:
            failure = error
        if self.out_arguments.is_out_refusal(failure):  # the first out= call inside use(): its kernels, then again
            self.out_arguments.register_kernels()
            _restore_random_state(state)
            return self.flat_vmap(func, *args, **kwargs)
        if isinstance(failure, control_flow.BooleanMaskError):  # an inner level's, already saying where
            raise failure
        if control_flow.MASK_REFUSAL in str(failure):
            if not self.mask_indexing.registered():
                # The first boolean-mask index of a batched mask inside use(): from now on it is computed per sample.
                self.mask_indexing.register()
                _restore_random_state(state)
                return self.flat_vmap(func, *args, **kwargs)
            raise control_flow.BooleanMaskError(control_flow.boolean_mask_message(failure)) from failure
        if batched:  # this call failed with its buffers batched (NOTE [batched fresh buffers]): functionalized now
            self.batched_buffers.discard(key)
            _restore_random_state(state)
            return self.flat_vmap(func, *args, **kwargs)
        if remembered:
            if OUTSIDE_REFUSAL in str(failure) or _is_write_refusal(failure):
                raise OutsideWriteError(_outside_write_message(failure, failure)) from failure
            # Functionalized, this call failed where it may run as written (a torch.autograd.Function, which
            # functionalize cannot run, on a path that writes nothing): run it as written, from the same random state.
            _restore_random_state(state)
            return self.levels.flat_vmap(func, *args, **kwargs)
        if CAPTURED_REFUSAL in str(failure):  # grad refuses a write into a captured tensor before vmap sees it
            raise OutsideWriteError(_outside_write_message(failure, failure)) from failure
        if not _may_be_write_refusal(failure):
            raise failure
        _restore_random_state(state)
        key = function_key(func) if key is None else key  # computed above where something was remembered
        try:
            result = self.levels.flat_vmap(self.batching_buffers(func), *args, **kwargs)
        except Exception:  # any failure with the buffers batched: functionalized instead (the NOTE above)
            _restore_random_state(state)
        else:
            functionalized.add(key)
            self.batched_buffers.add(key)
            return result
        try:
            result = self.levels.flat_vmap(self.functionalizing(func), *args, **kwargs)
        except SamplesDisagreeError as retry:  # functionalized, it ran past the write to a branch the samples split on
            functionalized.add(key)
            return self.split(retry, state, func, *args, **kwargs)
        except Exception as retry:
            if not _functionalization_failed(retry) or (not _is_write_refusal(failure)
                                                         and _may_be_write_refusal(retry)):
                raise  # an error of the function itself, which the first run did not reach
            raise OutsideWriteError(_outside_write_message(failure, retry)) from failure
        functionalized.add(key)
        return result

    def split(self, error: SamplesDisagreeError, state: random_state.Saved | None,
              func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The level run once per group of agreeing samples (registry.core.batch_split), or ``error`` again where this
        level does not batch the disagreement (an outer level splits)."""
        level = len(functorch_stack()) + 1  # the level this call's vmap made (popped again by now)
        result = batch_split.split_level(self.flat_vmap, error, level, func, *args,
                                         reset_random=lambda: _restore_random_state(state), **kwargs)
        if result is NotImplemented:
            raise error
        return result


# The default registry's (``Router.patches``), with the default fresh-buffer and out= patches.
PATCH = Functionalization(fresh_buffers.PATCH, out_arguments.PATCH, mask_indexing.PATCH, transform_calls.PATCH)
FUNCTIONALIZED = PATCH.functionalized  # the default patch's remembered functions (the harness and tests read it)


def remembering_apart() -> contextlib.AbstractContextManager[None]:
    """``Functionalization.remembering_apart`` of the default registry's patch."""
    return PATCH.remembering_apart()


def functionalizing_flat_vmap(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """vmap's implementation as the default registry's patch runs it (what ``install`` puts in place)."""
    return PATCH.flat_vmap(func, *args, **kwargs)
