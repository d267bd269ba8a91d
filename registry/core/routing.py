"""``use()``: route every call of a covered op to the selected composite, at PyTorch's dispatcher.

A Python kernel is registered once, process-wide (``Router.install()``; ``uninstall()`` removes it again), for every
aten overload of every covered op (in-place variants included) at the ``FuncTorchDynamicLayerFrontMode`` dispatch
key. The dispatcher reaches that key only while some functorch transform is active (``vmap``, ``grad``, ``jvp``,
``functionalize``, and the transforms ``jacrev``, ``jacfwd`` and ``hessian`` are made of), before autograd and
batching see the call. So every caller is routed: a
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
import functools
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
from torch._C._functorch import maybe_current_level  # noqa: PLC2701 - functorch's bindings have no public API

from registry.core import control_flow, cost, dynamic, patches
from registry.core.collector import collection_paused
from registry.core.context import (
    DISPATCH_KEY,
    context_of,
    functorch_stack,
    given_arguments,
    size_key,
    vmap_active,
    vmap_levels,
)
from registry.core.kernels.background import BUILD as _BUILD
from registry.core.kinds import FUNCTIONAL, KIND, KINDS
from registry.core.model import Op, Overload
from registry.core.ops import ORIGINAL, aten_schema
from registry.core.recording import RecordedDecision, Run
from registry.core.registration import TABLE, OpTable
from registry.core.runners import (
    InplaceRefusalError,
    batches_in_place,
    inplace_message,
    records_autograd,
    rewrapped,
    tensor_positions,
)
from registry.core.selector import POLICIES, SELECTOR, SelectionError, Selector, unknown_op_message

BACKEND_ENV = "MULTICOMPOSITE_ROUTING"  # "python" forces the Python kernels; "cpp" makes a failed build an error
# Decisions a router keeps (either backend's table): the oldest goes when a new one would pass it. A key holds
# caller-supplied values (sizes, dtypes, the functorch levels), so an unbounded table would grow with every program.
DECISION_CAPACITY = 8192
# In a frame's C++ id where its policy is "native" (routing.cpp's kNativePolicyBit): far above any frame count.
NATIVE_POLICY_BIT = 1 << 40

Signature = tuple[str, tuple[tuple[str, str], ...]]

# Kept under their old names for the tests that read them.
_rewrapped = rewrapped
_records_autograd = records_autograd
_inplace_message = inplace_message


class Frame:
    """What ``use()`` pushed: the policy and pins the kernels read, and the run it records into (None: it does not).
    Interned per (policy, pins) for frames that do not record."""

    __slots__ = ("cpp_id", "id", "pins", "policy", "prefixes", "records", "run", "signature")

    def __init__(self, router: Router, policy: str, pins: dict[str, str], run: Run | None = None) -> None:
        router.frame_count += 1
        self.id = router.frame_count  # what the C++ kernels read (0: no frame)
        self.policy = policy
        self.pins = pins
        self.run = run
        self.records = run is not None
        # What the C++ kernels read: negative where it records; NATIVE_POLICY_BIT set under policy "native" (the
        # C++ batching rules then run PyTorch's own rules too).
        cpp = self.id | (NATIVE_POLICY_BIT if policy == "native" else 0)
        self.cpp_id = -cpp if self.records else cpp
        self.signature: Signature = (policy, tuple(sorted(pins.items())))
        # The decision cache key's prefix per op, interned to an int: hashing it costs nothing on the hot path.
        self.prefixes = _Prefixes(router.prefixes, policy, pins, None if run is None else run.serial)


class _Prefixes(dict):
    """op -> the interned (op, policy, pin, recording run) of a frame; an op defined after the frame was made (a
    plugin) is interned on its first call."""

    def __init__(self, interned: dict[tuple, int], policy: str, pins: dict[str, str], run: int | None) -> None:
        super().__init__()
        self.interned = interned
        self.policy = policy
        self.pins = pins
        self.run = run

    def __missing__(self, op: str) -> int:
        interned = self.interned
        prefix = self[op] = interned.setdefault((op, self.policy, self.pins.get(op), self.run), len(interned))
        return prefix


def _no_frame(frame_id: int) -> None:
    """``Router.set_frame`` on the Python backend, whose kernels read the frames themselves."""


class _Local(threading.local):
    # Class defaults: a thread that never entered use() reads them without creating anything.
    frames: list[Frame] | tuple[()] = ()
    busy = False  # inside a composite or a native call this thread's kernel already decided: pass through


def _tensor_args(op: Op, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    # zip stops at the shorter: positional arguments cover a prefix of the parameters.
    found = {name: value for name, value in zip(op.params, args, strict=False) if isinstance(value, torch.Tensor)}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found[name] = value
    for name in op.tensor_lists:
        # NOTE: a Tensor[] parameter the op names in tensors= (lstm_cell's hx = [h, c]) stands for its first tensor:
        # the rules read whether h is batched. The C++ key (routing.cpp) holds every element's levels.
        value = kwargs.get(name) if name in kwargs else next(
            (v for n, v in zip(op.params, args, strict=False) if n == name), None)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            found[name] = value[0]
    return found


@functools.cache
def _schema_defaults(name: str, overload: str) -> dict[str, Any]:
    """The schema defaults of an op's own overload, by parameter name (what ``Context.given`` is measured from)."""
    schema = aten_schema(f"{name}.{overload}" if overload else name)
    return {arg.name: _MEMORY_FORMATS.get(arg.default_value, arg.default_value)
            if "MemoryFormat" in str(arg.type) else arg.default_value
            for arg in schema.arguments if arg.has_default_value()}


# c10::MemoryFormat as a schema default (an int) and as a call passes it.
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.preserve_format, 2: torch.channels_last,
                   3: torch.channels_last_3d}


# A decision as the kernels keep it: (composite, its kind's ``runs_native`` (out of place, in place: whether PyTorch's
# own kernel runs), whether self is batched wherever another argument is, the recorded decision it counts into where
# its frame records).
Chosen = tuple[Callable[..., Any], tuple[bool, bool], bool, RecordedDecision | None]


def _decider(router: Router) -> Callable[..., Chosen]:
    """The router's decision of one call: the cache key, then on a miss the context and the decision. The key costs a
    few reads of C++ state: the interpreter stack and each tensor's wrapper levels. The table is a closure variable,
    not an attribute: a hit reads nothing of the router."""
    decisions = router.decisions
    decide = router.selector.decide

    def decide_call(op: Op, frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any], compiling: bool) -> Chosen:
        tensors = _tensor_args(op, args, kwargs)
        functorch = functorch_stack()
        values = tuple(tensors.values())
        first = values[0] if values else None
        records = torch.is_grad_enabled() and any(t.requires_grad for t in values)
        given = given_arguments(_schema_defaults(op.name, op.overload), op.params, args, kwargs)
        key = (frame.prefixes[op.name], functorch, compiling, tuple(tensors), tuple(map(vmap_levels, values)),
               None if first is None else first.dtype, None if first is None else first.device.type,
               0 if first is None else first.numel().bit_length(), records, size_key(values), given)
        try:
            return decisions[key]
        except KeyError:
            pass
        generation = router.generation
        ctx = context_of(tensors, functorch, compiling=compiling, records=records, given=given,
                         native_batch_rules=router.batch_rules_serve(frame.policy))
        decision = decide(op.name, ctx, frame.policy, frame.pins.get(op.name))
        run = frame.run
        recorded = None if run is None else run.decided(op.name, ctx.stack, decision.composite, decision.kind,
                                                        decision.reason, tuple(ctx.batched),
                                                        native_loops=decision.native_loops)
        chosen = (decision.fn, KIND[decision.kind].runs_native, ctx.self_covers_batching, recorded)
        if router.generation == generation:  # else the evidence changed while this was decided: not kept
            router.keep(key, chosen)
        return chosen

    return decide_call


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


class Router:
    """The routing of one op table at PyTorch's dispatcher: what ``use()`` pushes, the decisions, the kernels of the
    active backend, and what ``install()`` put in place (``Registry.router``).

    Everything that was module state is here: the interned frames and key prefixes, the bounded decision table and
    its generation (bumped by every change of composites or evidence: both backends' tables are dropped), the
    routing signatures torch.compile traced under, the dispatcher Libraries, the backend and its compiled module, and
    the patched attributes with their originals. ``install()`` registers and patches everything; ``uninstall()``
    removes and restores it all, so that PyTorch behaves as before the import.
    """

    def __init__(self, table: OpTable, selector: Selector | None = None,
                 patch_set: tuple[patches.Patch, ...] = patches.PATCHES) -> None:
        self.table = table
        self.selector = Selector(table) if selector is None else selector
        if self.selector.table is not table:
            raise ValueError("Router: the selector decides for another op table than the one given")
        self.local = _Local()
        self.frames: dict[Signature, Frame] = {}  # interned frames that do not record
        self.plain_frames: dict[str, Frame] = {}  # policy -> its frame without pins (the same objects)
        self.frame_count = 0
        self.prefixes: dict[tuple, int] = {}
        self.decisions: dict[tuple, Chosen] = {}  # at most DECISION_CAPACITY, oldest first
        self.generation = 0
        # Routing signatures ((policy, pins), or None outside use()) under which torch.compile traced through a
        # kernel. A graph bakes in the composite chosen while it was traced, and Dynamo does not guard on use(): when
        # the routing changes, compiled graphs traced under another routing are dropped so that they are traced again.
        self.traced_signatures: set[Signature | None] = set()
        self.lock = threading.RLock()
        self.library: torch.library.Library | None = None  # the dynamic-shape refusals' and control flow's
        self.python_library: torch.library.Library | None = None  # the Python backend's kernels, while active
        self.refusing: set[str] = set()  # dynamic-shape overloads refused under vmap (registry.core.dynamic)
        self.routed_ops: set[str] = set()  # ops whose overloads have routing kernels (later ones get theirs at use())
        self.backend: str | None = None  # "cpp" or "python", once chosen
        self.cpp: ModuleType | None = None  # the compiled kernels' module while the C++ backend is active
        self.batch_rules_enabled = True  # the C++ batching rules inside use() (set_batch_rules_enabled)
        # What use() tells the C++ kernels on entering a block and on leaving one (its frame's id, 0 outside use()):
        # cpp.set_frame both while the C++ backend is active; on the Python one, entering looks for a background
        # build that landed (kernels/background.py) and leaving does nothing.
        self.enter_frame: Callable[[int], None] = self.enter_on_python
        self.set_frame: Callable[[int], None] = _no_frame
        self.patch_set = patch_set  # installed in order, uninstalled in reverse (registry.core.patches)
        # Those whose kernels the C++ backend registers with its routing kernels, and drops with them.
        self.compiled_patches = tuple(patch for patch in patch_set if isinstance(patch, patches.CompiledKernels))
        self.patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) while installed
        self.installed = False
        self.routed_size = -1  # len(routed_ops) once installed, -1 before: what use() compares with the table's size
        self.removed = False  # uninstall() was called: use() routes nothing until install()
        self.decide = _decider(self)
        self.selector.listeners.append(self.clear)

    # --- the decision table -------------------------------------------------------------------------------------

    def keep(self, key: tuple, chosen: Chosen) -> None:
        decisions = self.decisions
        if len(decisions) >= DECISION_CAPACITY:
            with contextlib.suppress(StopIteration, KeyError, RuntimeError):  # another thread evicted it first
                del decisions[next(iter(decisions))]
        decisions[key] = chosen

    def clear(self) -> None:
        """A new generation: forget every decision of both backends (composites or evidence changed)."""
        self.generation += 1
        self.decisions.clear()
        if self.cpp is not None:
            self.cpp.clear()

    def batch_rules_serve(self, policy: str) -> bool:
        """Whether PyTorch's own kernels run with the C++ batching rules (registry.core.batch_rules) in a frame of
        ``policy``: on the C++ backend, with the rules enabled, under any policy but native."""
        return self.cpp is not None and self.batch_rules_enabled and policy != "native"

    def set_batch_rules_enabled(self, enabled: bool) -> None:
        """Turn the C++ batching rules off (False) or back on inside ``use()`` (the baseline of
        ``bench/batch_rules.py``). Decisions by cost weigh native's time with or without them: a new generation."""
        if self.cpp is None:
            raise RuntimeError("set_batch_rules_enabled: the C++ routing backend is not active; the batching rules "
                               "are its kernels (set_routing_backend('cpp') first)")
        with self.lock:
            self.cpp.set_batch_rules_enabled(enabled)
            self.batch_rules_enabled = enabled
        self.selector.clear()

    # --- frames -------------------------------------------------------------------------------------------------

    def validate(self, policy: str, pins: Mapping[str, str] | None) -> dict[str, str]:
        if policy not in POLICIES:
            raise SelectionError(f"use(): unknown policy {policy!r}; policies are {', '.join(POLICIES)}")
        checked = dict(pins or {})
        self.table.load()
        ops, composites = self.table.ops, self.table.composites
        for op, pin in checked.items():
            if op not in ops:
                raise SelectionError(f"use(pins=...): {unknown_op_message(op, ops)}")
            if pin not in composites[op] and pin not in KINDS:
                raise SelectionError(
                    f"use(pins=...): {op} has no composite or kind {pin!r}; registered: {', '.join(composites[op])}"
                )
        return checked

    def frame(self, policy: str, pins: Mapping[str, str] | None) -> Frame:
        if pins:
            return self.interned_frame(policy, pins)
        # use() and use(policy): looked up by the policy alone, building no key (every use() block)
        frame = self.plain_frames.get(policy)
        if frame is None:
            frame = self.plain_frames[policy] = self.interned_frame(policy, None)
        return frame

    def interned_frame(self, policy: str, pins: Mapping[str, str] | None) -> Frame:
        key = (policy, tuple(sorted(pins.items())) if pins else ())
        frame = self.frames.get(key)
        if frame is None:
            frame = self.frames[key] = Frame(self, policy, self.validate(policy, pins))
        return frame

    def recording_frame(self, frame: Frame, run: Run) -> Frame:
        """``frame``'s policy and pins, recording into ``run``."""
        found = run.frames.get(frame.signature)
        if found is None:
            found = run.frames[frame.signature] = Frame(self, frame.policy, frame.pins, run)
        return found

    def drop_graphs_traced_elsewhere(self, signature: Signature | None) -> None:
        """Forget compiled graphs traced under a routing other than ``signature`` (they baked in its composites)."""
        if self.traced_signatures - {signature}:
            torch._dynamo.reset()
            self.traced_signatures.clear()

    def enter_on_python(self, frame_id: int) -> None:
        """``enter_frame`` on the Python backend: where the C++ kernels compiled in the background have landed,
        switch to them here, outside any kernel call and before the block's frame is pushed."""
        if _BUILD.landed:
            _BUILD.adopt(lambda: self.set_routing_backend("cpp"), inside_use=bool(self.local.frames))
            self.set_frame(frame_id)  # the C++ kernels' where the switch happened, else nothing

    def routing_on(self) -> bool:
        """Inside ``use()`` with a policy that routes, and not inside a composite or a decided native call."""
        local = self.local
        frames = local.frames
        if not frames or local.busy or frames[-1].policy == "native":
            return False
        cpp = self.cpp
        return cpp is None or not cpp.busy()

    # --- the Python kernels -------------------------------------------------------------------------------------

    def make_kernel(self, op: Op, overload: Overload, native: Any, *, eager_autograd: bool = False,
                    ) -> Callable[..., Any]:
        """The routing kernel of one overload; ``eager_autograd``: the one at the Autograd key, which routes only
        while autograd records (outside transforms, where the functorch kernel is never reached). Everything it
        reads per call is a closure variable."""
        call_native = native.call_boxed
        positions = tensor_positions(overload.qualified_name)
        adapt = overload.adapt
        inplace = overload.inplace
        native_in_place = batches_in_place(overload)
        local = self.local
        decide_call = self.decide
        traced = self.traced_signatures
        is_compiling = torch.compiler.is_compiling
        name = overload.name
        packet = name.partition(".")[0]

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            fixed = rewrapped(args, positions)
            if fixed is not None:  # a wrapped number: PyTorch's own kernel, never a composite
                return call_native(keyset, *fixed, **kwargs)
            frames = local.frames
            if not frames or local.busy:
                if not frames and is_compiling():
                    traced.add(None)
                return call_native(keyset, *args, **kwargs)
            frame = frames[-1]
            compiling = is_compiling()
            if compiling:
                traced.add(frame.signature)
            if frame.policy == "native":
                return call_native(keyset, *args, **kwargs)
            if eager_autograd and not records_autograd(args, kwargs):
                return call_native(keyset, *args, **kwargs)
            cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
            composite, native_runs, self_covers, recorded = decide_call(op, frame, cargs, ckwargs, compiling)
            if recorded is not None:
                recorded.called(name)
            if inplace and not self_covers:
                raise InplaceRefusalError(inplace_message(packet))
            # The layers below this one reach this kernel again with the same call: it is decided here, once.
            local.busy = True
            try:
                # The kind's entry says (registry.core.kinds): native, or mutating in place; PyTorch's own in-place
                # kernel also where the decision is native and functorch batches it (runners.batches_in_place).
                if native_runs[inplace] or (native_in_place and native_runs[False]):
                    return call_native(keyset, *args, **kwargs)
                # An in-place variant computes the new value out of place (PyTorch's own out-of-place op where the
                # decision is native: in-place variants lack batching rules that the out-of-place ones have), then
                # writes it into self (runners.runner does the same for the C++ backend).
                result = composite(*cargs, **ckwargs)
                return args[0].copy_(result) if inplace else result
            finally:
                local.busy = False

        kernel.__name__ = f"multicomposite_{name.replace('.', '_')}"
        return kernel

    def make_derivative_kernel(self, op: str, name: str, functional: Callable[..., Any], native: Any,
                               ) -> Callable[..., Any]:
        """A derivative op (``masked_scatter_backward``) of ``op``: its functional form under vmap, where PyTorch's
        kernel has no batching rule and loops, unless ``op`` chooses native at these sizes by cost
        (registry.core.cost); PyTorch's own kernel everywhere else."""
        call_native = native.call_boxed
        local = self.local
        positions = tensor_positions(name)
        decide_call = self.decide
        op_def = self.table.ops[op]
        of_op = cost.derivative_arguments(op, name, self.table.signatures, op_def.tensor_args)

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            fixed = rewrapped(args, positions)
            if fixed is not None:
                return call_native(keyset, *fixed, **kwargs)
            frames = local.frames
            if not frames or local.busy or frames[-1].policy == "native":
                return call_native(keyset, *args, **kwargs)
            if not vmap_active():
                return call_native(keyset, *args, **kwargs)
            if of_op is not None and decide_call(op_def, frames[-1], (), of_op(args, kwargs), False)[1][0]:
                return call_native(keyset, *args, **kwargs)  # the op itself runs natively at these sizes
            run = frames[-1].run
            if run is not None:
                _record_derivative(run, op, name, functional)
            local.busy = True
            try:
                return functional(*args, **kwargs)
            finally:
                local.busy = False

        kernel.__name__ = f"multicomposite_{name.replace('.', '_')}"
        return kernel

    # --- registration at the dispatcher -------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.routed_size == len(self.table.ops)

    def install(self) -> None:
        """Register everything at PyTorch's dispatcher and patch the two Python-level paths, once (``use()`` calls
        it; about 12 us an overload): the routing kernels of every op on the C++ backend where it builds or loads,
        else on the Python one; the dynamic-shape refusals; control flow's kernels; ``Tensor.contiguous`` and
        functorch's ``_flat_vmap``. Ops defined since get their kernels at the next call."""
        if self.ready():
            return
        with self.lock:
            self.removed = False
            self.table.load()
            if self.ready():
                return
            if self.backend is None:
                self.backend = self.choose_backend()
            new = [op for op in self.table.ops.values() if op.name not in self.routed_ops]
            with collection_paused():  # collector.py says why
                self.register_routing(new)
            self.routed_ops.update(op.name for op in new)
            if self.library is None:
                self.library = torch.library.Library("aten", "IMPL")
                control_flow.register(self.library, self.routing_on)
            dynamic.register(self.library, self.routing_on, self.refusing)
            if not self.installed:
                for patch in self.patch_set:  # out=, functorch's _flat_vmap, Function.apply, checkpoint, ...
                    patch.install(self.routing_on)
                self.patch(torch.Tensor, "contiguous", _contiguous)
                self.installed = True
            self.routed_size = len(self.routed_ops)

    def patch(self, owner: Any, attribute: str, value: Any) -> None:
        self.patches.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, value)

    def uninstall(self) -> None:
        """Remove every kernel ``install()`` registered (both backends' routing kernels, the Autograd-key kernels,
        the dynamic-shape refusals, control flow's and the fresh-buffer regions') and restore every patched
        attribute: PyTorch then behaves as before the import, inside ``use()`` blocks too, which route nothing
        until ``install()`` puts it all back. Outside ``use()`` only."""
        if self.local.frames:
            raise RuntimeError("uninstall: called inside use(); call it outside")
        with self.lock:
            self.unregister_routing()
            if self.library is not None:
                self.library._destroy()
                self.library = None
            self.refusing.clear()
            for owner, attribute, original in reversed(self.patches):
                setattr(owner, attribute, original)
            self.patches.clear()
            for patch in reversed(self.patch_set):  # each wraps what those before it wrapped: unwrapped first
                patch.uninstall()
            self.routed_ops.clear()
            self.installed = False
            self.routed_size = -1
            self.removed = True
            self.clear()
            if self.traced_signatures:
                self.drop_graphs_traced_elsewhere(None)
                self.traced_signatures.clear()

    def choose_backend(self) -> str:
        """"cpp" when the compiled kernels build or load; else "python", saying once why and how to get the fast
        path."""
        wanted = os.environ.get(BACKEND_ENV, "").strip().lower()
        if wanted not in ("", "cpp", "python"):
            raise SelectionError(f"{BACKEND_ENV}={wanted!r}: expected cpp or python (or unset: cpp where it builds)")
        if wanted == "python":
            return "python"
        from registry.core import kernels

        try:
            # cpp: wait for the build; unset: never wait, the build runs in the background (kernels/background.py)
            self.cpp = kernels.load(wait=wanted == "cpp")
        except kernels.KernelBuildError as error:
            if wanted == "cpp":
                raise
            warnings.warn(f"multicomposite: use() runs its Python routing kernels (a few microseconds more per call "
                          f"under a transform): {error}; or set {BACKEND_ENV}=python to choose them", stacklevel=5)
            return "python"
        if self.cpp is None:
            return "python"
        self.cpp.set_capacity(DECISION_CAPACITY)
        return "cpp"

    def register_routing(self, ops: list[Op]) -> None:
        """Register the routing kernels of ``ops`` on the active backend."""
        if self.backend == "cpp":
            from registry.core import routing_cpp

            if self.cpp is None:
                raise RuntimeError("routing: the C++ backend is active but its kernels are not loaded; report this bug")
            routing_cpp.register(self.cpp, ops, self)
            for patch in self.compiled_patches:  # after the routing kernels, which keep the overloads they route
                patch.register_compiled(self.cpp)
            self.enter_frame = self.set_frame = self.cpp.set_frame
            return
        if self.python_library is None:
            self.python_library = torch.library.Library("aten", "IMPL")
        library = self.python_library
        derivatives = self.table.derivatives
        with warnings.catch_warnings():
            # PyTorch warns once that a kernel overrides FuncTorchDynamicLayerFrontMode's: that is the point here.
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for op in ops:
                for overload in op.overloads:
                    native = torch.library.get_kernel(overload.qualified_name, DISPATCH_KEY)
                    library.impl(overload.name, self.make_kernel(op, overload, native), DISPATCH_KEY,
                                 with_keyset=True)
                    if overload.name in op.eager_autograd:
                        # The Autograd alias key: one registration for every backend's autograd key. The native
                        # kernel there is VariableType's, the same function for every backend.
                        native = torch.library.get_kernel(overload.qualified_name, "AutogradCPU")
                        library.impl(overload.name, self.make_kernel(op, overload, native, eager_autograd=True),
                                     "Autograd", with_keyset=True)
                for name, functional in derivatives[op.name].items():
                    native = torch.library.get_kernel(f"aten::{name}", DISPATCH_KEY)
                    library.impl(name, self.make_derivative_kernel(op.name, name, functional, native),
                                 DISPATCH_KEY, with_keyset=True)

    def unregister_routing(self) -> None:
        """Remove the routing kernels of the active backend (the Libraries that hold them are destroyed)."""
        if self.python_library is not None:
            self.python_library._destroy()
            self.python_library = None
        if self.cpp is not None and self.cpp.registered():
            self.unregister_cpp(self.cpp)

    def unregister_cpp(self, module: ModuleType) -> None:
        """Destroy the C++ routing's Library, and with it the kernels the patches registered into it."""
        module.unregister_all()
        for patch in self.compiled_patches:
            patch.compiled_dropped()

    def routing_registered(self) -> bool:
        if self.backend == "python":
            return self.python_library is not None
        return self.cpp is not None and self.cpp.registered()

    def set_routing_kernels(self, registered: bool) -> None:
        """Remove (False) or put back (True) the routing kernels of the active backend, outside ``use()``: what a
        benchmark compares a process with and without (``bench.routing``'s (r0)). The kernels are registered
        first."""
        if self.local.frames:
            raise RuntimeError("set_routing_kernels: called inside use(); call it outside")
        self.install()
        with self.lock:
            if registered == self.routing_registered():
                return
            if registered:
                self.register_routing([self.table.ops[name] for name in self.routed_ops])
            else:
                self.unregister_routing()

    def routing_backend(self) -> str:
        """Which kernels route ``use()``: ``"cpp"`` (compiled) or ``"python"``; registers them if nothing has yet."""
        self.install()
        assert self.backend is not None
        return self.backend

    def set_routing_backend(self, backend: str) -> None:
        """Route on ``backend`` ("cpp" or "python") from now on, in this process (tests and benchmarks run both).

        Outside ``use()`` only. Raises KernelBuildError when "cpp" cannot be built or loaded."""
        if backend not in ("cpp", "python"):
            raise SelectionError(f"set_routing_backend: unknown backend {backend!r}; backends are cpp, python")
        if self.local.frames:
            raise RuntimeError("set_routing_backend: called inside use(); switch backends outside it")
        self.install()
        if self.backend == backend:
            return
        with self.lock:
            if backend == "cpp":
                from registry.core import kernels

                module = kernels.load()
                self.unregister_routing()
                self.cpp = module
                module.set_capacity(DECISION_CAPACITY)
            elif self.cpp is not None:
                self.unregister_cpp(self.cpp)
                self.cpp.set_frame(0)
                self.cpp.clear()
                self.cpp = None
                self.enter_frame, self.set_frame = self.enter_on_python, _no_frame
            self.backend = backend
            self.register_routing([self.table.ops[name] for name in self.routed_ops])
            self.clear()


def _record_derivative(run: Run, op: str, name: str, functional: Callable[..., Any]) -> None:
    stack = tuple(transform for transform, _ in functorch_stack())
    for recorded in run.decisions:
        if recorded.op == op and name in recorded.overloads and recorded.stack == stack:
            recorded.called(name)
            return
    run.decided(op, stack, getattr(functional, "__name__", name), FUNCTIONAL.name,
                f"aten::{name} (a derivative op of {op}) runs its functional form under vmap, where PyTorch's "
                "kernel has no batching rule").called(name)


# The default router, of the default op table and its selector: what the module-level names route with.
ROUTER = Router(TABLE, SELECTOR)


class use(contextlib.ContextDecorator):  # noqa: N801 - used like a function: `with registry.use():`
    """Route covered ops to the selected composite: ``with use():`` or ``@use()``; nests (inner wins), per thread.

    ``policy``: ``auto`` (default), ``fastest``, ``rules``, or ``native`` (route nothing, for A/B). ``pins`` forces a
    kind or a composite per op, ``{"index_fill": "functional"}``; a pin invalid where the op is called raises there.
    ``record``: keep what the block decided (``with use(record=True) as run:``, then ``run.decisions``,
    ``run.calls``, ``run.summary()``); a ``use()`` nested inside records into the same run, a nested
    ``use(record=True)`` into its own, which the enclosing run sees too. Calls are routed under torch.func transforms,
    where PyTorch's own kernels raise, loop or go wrong; outside any transform PyTorch's own kernel runs.
    """

    __slots__ = ("_frame", "_record", "_router", "_run")  # _run: set by a recording block's enter

    def __init__(self, policy: str = "auto", pins: Mapping[str, str] | None = None, *, record: bool = False,
                 router: Router = ROUTER) -> None:
        # router.ready(), inlined (every block): not installed, or ops defined since
        if router.routed_size != len(router.table.ops) and not router.removed:
            router.install()
        self._router = router
        self._frame = router.frame(policy, pins)
        self._record = record

    @property
    def policy(self) -> str:
        return self._frame.policy

    @property
    def pins(self) -> dict[str, str]:
        return dict(self._frame.pins)

    @property
    def run(self) -> Run:
        """What the block decided (``record=True``), once entered."""
        run: Run | None = getattr(self, "_run", None)
        if run is None:
            raise RuntimeError("use().run: only a use(record=True) block records; enter it first")
        return run

    @property
    def decisions(self) -> list[RecordedDecision]:
        return self.run.decisions

    @property
    def calls(self) -> dict[str, int]:
        return self.run.calls

    def summary(self) -> str:
        return self.run.summary()

    def __enter__(self) -> use:
        router = self._router
        local = router.local
        frames = local.frames
        if frames.__class__ is tuple:
            frames = local.frames = []
        frame = self._frame
        if self._record or (frames and frames[-1].records):  # a recording block, or one nested inside
            frame = self._recording(frame, frames)
        router.enter_frame(frame.cpp_id)  # before the push: on the Python backend it may switch backends
        frames.append(frame)
        if router.traced_signatures:
            router.drop_graphs_traced_elsewhere(frame.signature)
        return self

    def _recording(self, frame: Frame, frames: list[Frame]) -> Frame:
        if self._record:  # its own run, which an enclosing recording block's sees into
            self._run = Run(parent=frames[-1].run if frames and frames[-1].records else None)
            return self._router.recording_frame(frame, self._run)
        run = frames[-1].run
        assert run is not None
        return self._router.recording_frame(frame, run)  # inside a recording block: record into its run

    def __exit__(self, *exc_info: object) -> None:
        router = self._router
        frames = router.local.frames
        frames.pop()
        router.set_frame(frames[-1].cpp_id if frames else 0)
        if router.traced_signatures:
            router.drop_graphs_traced_elsewhere(frames[-1].signature if frames else None)


def register_kernels() -> None:
    """Install the default router's kernels and patches (``use()`` calls it)."""
    ROUTER.install()


def routing_backend() -> str:
    """Which kernels route ``use()``: ``"cpp"`` (compiled) or ``"python"``; registers them if nothing has yet."""
    return ROUTER.routing_backend()


def set_routing_backend(backend: str) -> None:
    """Route on ``backend`` ("cpp" or "python") from now on, in this process (tests and benchmarks run both).

    Outside ``use()`` only. Raises KernelBuildError when "cpp" cannot be built or loaded."""
    ROUTER.set_routing_backend(backend)


def set_routing_kernels(registered: bool) -> None:
    """Remove (False) or put back (True) the default router's routing kernels, outside ``use()`` (``bench.routing``'s
    (r0))."""
    ROUTER.set_routing_kernels(registered)


def routing_active() -> bool:
    """Whether the current thread is inside ``use()``."""
    return bool(ROUTER.local.frames)


def under_transform() -> bool:
    """Whether some functorch transform is active on this thread (where the routing kernels are reached)."""
    return maybe_current_level() is not None
