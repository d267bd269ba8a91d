"""Pre-2.0 ``torch.autograd.Function``s (``forward(ctx, ...)``, no ``setup_context``) under torch.func transforms.

PyTorch's ``Function.apply`` refuses such a Function under any transform ("it must override the setup_context
staticmethod") before any aten op is dispatched, so no routing kernel ever sees it. Inside ``use()`` the patched
``apply`` treats the Function as an op with two composites, chosen by the transform stack:

- ``adapted``: its own forward and backward (and ``jvp``), adapted to the new style. A new-style Function class is
  generated once per old class: its ``forward(*args)`` runs the old forward with a recording stand-in for ``ctx``,
  and its ``setup_context`` replays onto each level's real ``ctx`` what the old forward did there
  (``save_for_backward``, ``save_for_forward``, ``mark_dirty``, ``mark_non_differentiable``,
  ``set_materialize_grads``, attributes). Tensors the old forward kept that are neither inputs nor outputs
  (intermediates, saved or set as attributes) leave the forward as extra, non-differentiable outputs, so every level
  saves its own wrapper of them. It has ``generate_vmap_rule = True``; where the old forward or backward is not
  batchable (``item()``, NumPy, a data-dependent branch), that call runs once per sample at its vmap level instead.
- ``autograd``: the old forward called with a stand-in ``ctx`` and no custom backward, so the transforms
  differentiate its ops. Chosen under forward-mode AD (``jvp``, ``jacfwd``, ``hessian``) when the Function defines
  no ``jvp``, when it defines no backward, and for a ``once_differentiable`` backward under two or more reverse-mode
  levels (the loop could not differentiate it twice either, but its forward's ops can be).

``decisions()`` lists each choice made (Function, stack, composite, why). Outside ``use()``, outside transforms, for
new-style Functions and under ``torch.compile`` PyTorch's own ``apply`` runs. See docs/functions.md.
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree  # noqa: PLC2701 - PyTorch's pytree
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    CVmapInterpreterPtr,
    _add_batch_dim,
    _unwrap_batched,
    current_level,
    get_unwrapped,
    is_batchedtensor,
    is_gradtrackingtensor,
    peek_interpreter_stack,
)
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    TransformType as _TransformType,
)
from torch._functorch.utils import (  # noqa: PLC2701 - functorch's internals have no public API
    enable_single_level_autograd_function,
    unwrap_dead_wrappers,
)
from torch.autograd.function import (
    Function,
    _SingleLevelFunction,  # noqa: PLC2701 - what functorch calls
    once_differentiable,
)

from registry.core import random_state
from registry.core.context import functorch_stack
from registry.core.stacks import format_stack

# PyTorch's ``Function.apply``: the function inside the classmethod, its code (put back by uninstall()), and a copy of
# it with that code, which the patched code calls for everything it does not take over.
_APPLY_FUNCTION = Function.__dict__["apply"].__func__
PYTORCH_APPLY_CODE = _APPLY_FUNCTION.__code__
pytorch_apply = types.FunctionType(PYTORCH_APPLY_CODE, _APPLY_FUNCTION.__globals__, "apply",
                                    _APPLY_FUNCTION.__defaults__, _APPLY_FUNCTION.__closure__)
_BASE_SETUP_CONTEXT = _SingleLevelFunction.setup_context
_BASE_BACKWARD = _SingleLevelFunction.backward
_BASE_JVP = _SingleLevelFunction.jvp
_BASE_VMAP = Function.vmap
_ONCE_DIFFERENTIABLE_CODE = once_differentiable(lambda ctx: None).__code__
_transforms_active = torch._C._are_functorch_transforms_active
_FRONT_KEY = torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode


def _below_functorch() -> bool:
    """Whether the caller runs inside a dispatcher kernel below functorch's front key (which is excluded while a
    level's kernels run), rather than in Python code above the dispatcher."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(_FRONT_KEY)
_NO_CODE = (lambda: None).__code__
# Names in a forward's code that take its values past autograd: differentiating its ops would drop their tangents.
_NOT_DIFFERENTIABLE = frozenset({"data", "detach", "detach_", "numpy", "no_grad", "item", "tolist", "set_"})


class LegacyDecision(NamedTuple):
    """One choice: which composite ran a pre-2.0 Function under which stack, and why."""

    function: str
    stack: str
    composite: str  # "adapted", "autograd", "autograd kernel", a direct form's ("keep activations"), "recompute"
    reason: str


# --- what an old forward does to its ctx ----------------------------------------------------------------------------

# A tensor the forward handed to ctx, by where it comes from: an input, an output, or an intermediate (which leaves
# the adapted forward as an extra output).
_INPUT, _OUTPUT, _EXTRA = 0, 1, 2
_Slot = tuple[int, int]


class _RecordingCtx:
    """What the old forward gets as ``ctx``: it records every call and attribute for ``setup_context`` to replay."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        state = {"saved": None, "saved_forward": None, "dirty": (), "non_differentiable": (), "materialize": None,
                 "attributes": {}, "needs_input_grad": needs_input_grad}
        object.__setattr__(self, "_mc_state", state)

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self._mc_state["saved"] = tensors

    def save_for_forward(self, *tensors: torch.Tensor | None) -> None:
        self._mc_state["saved_forward"] = tensors

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        self._mc_state["dirty"] = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self._mc_state["non_differentiable"] = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self._mc_state["materialize"] = value

    def mark_shared_storage(self, *pairs: Any) -> None:  # deprecated no-op in PyTorch too
        pass

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        return self._mc_state["needs_input_grad"]

    @property
    def saved_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(self._mc_state["saved"] or ())

    saved_variables = saved_tensors

    def __setattr__(self, name: str, value: Any) -> None:
        self._mc_state["attributes"][name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self._mc_state["attributes"][name]
        except KeyError:
            raise AttributeError(f"ctx has no attribute {name!r} (the forward did not set it)") from None


@dataclass
class _Record:
    """What one old forward did, with every tensor replaced by its slot; made once per call."""

    single: bool  # the forward returned one tensor, not a tuple
    outputs: int  # the user's outputs (the adapted forward returns ``extras`` more)
    extras: int
    saved: tuple[_Slot | None, ...] | None
    saved_forward: tuple[_Slot | None, ...] | None
    dirty: tuple[_Slot, ...]
    non_differentiable: tuple[_Slot, ...]
    materialize: bool | None
    constants: dict[str, Any]  # attributes without tensors
    tensor_attributes: dict[str, tuple[pytree.TreeSpec, list[Any]]]  # leaves: a slot or a non-tensor value
    needs_input_grad: tuple[bool, ...] = ()


@dataclass
class _Layout:
    """What a level's ctx carries for the backward and jvp: where each saved and attribute tensor sits."""

    saved: int  # the first ``saved`` of ctx.saved_tensors are the forward's save_for_backward
    saved_forward: tuple[int, int]  # [start, stop) of its save_for_forward
    tensor_attributes: dict[str, tuple[pytree.TreeSpec, list[Any]]]  # leaves: ("saved", index) or a value
    outputs: int
    extras: int
    saved_none: tuple[int, ...] = ()  # positions of None in the user's save_for_backward


def _record(ctx: _RecordingCtx, args: tuple[Any, ...], result: Any) -> tuple[_Record, list[torch.Tensor]]:
    """The record of a finished old forward, and the intermediates it kept (the extra outputs)."""
    state = ctx._mc_state
    single = not isinstance(result, tuple)
    outputs = (result,) if single else tuple(result)
    inputs_by_id = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    outputs_by_id = {id(o): i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)}
    extras: list[torch.Tensor] = []
    extras_by_id: dict[int, int] = {}

    def slot(tensor: torch.Tensor, input_first: bool = False) -> _Slot:
        if input_first and id(tensor) in inputs_by_id:  # mark_dirty names inputs
            return (_INPUT, inputs_by_id[id(tensor)])
        if id(tensor) in outputs_by_id:
            return (_OUTPUT, outputs_by_id[id(tensor)])
        if id(tensor) in inputs_by_id:
            return (_INPUT, inputs_by_id[id(tensor)])
        if id(tensor) not in extras_by_id:
            extras_by_id[id(tensor)] = len(extras)
            extras.append(tensor)
        return (_EXTRA, extras_by_id[id(tensor)])

    def slots(tensors: Sequence[Any] | None) -> tuple[_Slot | None, ...] | None:
        if tensors is None:
            return None
        return tuple(None if t is None else slot(t) for t in tensors)

    constants: dict[str, Any] = {}
    tensor_attributes: dict[str, tuple[pytree.TreeSpec, list[Any]]] = {}
    for name, value in state["attributes"].items():
        leaves, spec = pytree.tree_flatten(value)
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            tensor_attributes[name] = (spec, [("slot", slot(leaf)) if isinstance(leaf, torch.Tensor) else
                                              ("value", leaf) for leaf in leaves])
        else:
            constants[name] = value
    record = _Record(
        single=single, outputs=len(outputs), extras=0, saved=slots(state["saved"]),
        saved_forward=slots(state["saved_forward"]),
        dirty=tuple(slot(t, input_first=True) for t in state["dirty"]),
        non_differentiable=tuple(slot(t) for t in state["non_differentiable"]),
        materialize=state["materialize"], constants=constants, tensor_attributes=tensor_attributes,
        needs_input_grad=state["needs_input_grad"])
    record.extras = len(extras)
    return record, extras


class _BackwardCtx:
    """The ctx the old backward and jvp see: the level's real ctx, with the saved tensors and the tensor attributes
    the forward kept read back from what ``setup_context`` saved."""

    def __init__(self, ctx: Any, layout: _Layout, saved: tuple[torch.Tensor, ...], forward: bool) -> None:
        object.__setattr__(self, "_mc_ctx", ctx)
        object.__setattr__(self, "_mc_all_saved", saved)
        if forward:
            start, stop = layout.saved_forward
            own = saved[start:stop]
        else:
            own = list(saved[:layout.saved])
            for position in layout.saved_none:
                own.insert(position, None)
            own = tuple(own)
        object.__setattr__(self, "_mc_saved", tuple(own))
        object.__setattr__(self, "_mc_layout", layout)

    @property
    def saved_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self._mc_saved

    saved_variables = saved_tensors

    def __getattr__(self, name: str) -> Any:
        layout = self._mc_layout
        if name in layout.tensor_attributes:
            spec, leaves = layout.tensor_attributes[name]
            values = [self._mc_all_saved[leaf[1]] if leaf[0] == "saved" else leaf[1] for leaf in leaves]
            return pytree.tree_unflatten(values, spec)
        return getattr(self._mc_ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._mc_ctx, name, value)


# --- the per-sample fallback at one vmap level ----------------------------------------------------------------------

def _vmap_level() -> tuple[int, int] | None:
    """(level, batch size) of the innermost transform when it is a vmap, else None."""
    interpreter = peek_interpreter_stack()
    if interpreter is None or interpreter.key() != _TransformType.Vmap:
        return None
    return current_level(), CVmapInterpreterPtr(interpreter).batchSize()


def _per_sample(fn: Callable[..., Any], args: tuple[Any, ...], level: int, batch_size: int) -> Any:
    """``fn(*args)`` at vmap level ``level``, run once per sample of that level and stacked back into one batched
    result (a batched tensor's physical form is sliced, so ``fn`` sees tensors not batched at that level)."""
    unwrapped = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            value, dim = _unwrap_batched(arg, level)
            unwrapped.append((value, dim))
        else:
            unwrapped.append((arg, None))
    results = []
    for b in range(batch_size):
        sample = tuple(value if dim is None else value.select(dim, b) for value, dim in unwrapped)
        results.append(fn(*sample))
    first = results[0]
    if isinstance(first, torch.Tensor) or first is None:
        columns: list[Any] = [results]
    else:
        columns = [list(column) for column in zip(*results, strict=True)]
    stacked = []
    for column in columns:
        if column[0] is None or not isinstance(column[0], torch.Tensor):
            stacked.append(column[0])
        else:
            stacked.append(_add_batch_dim(torch.stack(column), 0, level))
    if isinstance(first, torch.Tensor) or first is None:
        return stacked[0]
    return tuple(stacked)


class _CallState(threading.local):
    calls: list[_Call]

    def __init__(self) -> None:
        self.calls = []


@dataclass
class _Call:
    """One ``apply`` of a pre-2.0 Function running adapted: what its forward recorded, for every level's
    ``setup_context``."""

    needs_input_grad: tuple[bool, ...]
    stack: str
    record: _Record | None = None


@dataclass
class LegacyFunctions:
    """The adapter: the generated new-style class per old class, the classes that must run per sample under vmap,
    the decisions made, and the call in progress on each thread."""

    decision_limit: int = 256
    _adapted: dict[type, type] = field(default_factory=dict)
    _looped: set[type] = field(default_factory=set)  # old classes whose forward is not batchable
    _looped_backward: set[type] = field(default_factory=set)  # old classes whose backward is not batchable
    _decisions: OrderedDict[tuple[Any, Any], LegacyDecision] = field(default_factory=OrderedDict)
    _direct: dict[type, tuple[Callable[..., Any], str, str]] = field(default_factory=dict)
    _local: _CallState = field(default_factory=_CallState)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register_direct(self, cls: type, fn: Callable[..., Any], reason: str,
                        composite: str = "keep activations") -> None:
        """Run ``cls.apply(*args)`` under transforms as ``fn(*args)`` (a Function whose backward only recomputes
        what its forward computed, such as checkpointing's: running the computation directly is the same program);
        ``composite`` names that choice in the decision log."""
        self._direct[cls] = (fn, composite, reason)

    def record(self, function: str, stack: str, composite: str, reason: str) -> None:
        """Log a choice made elsewhere (checkpointing's), under the same bound."""
        key = (function, stack)
        if self._decisions.get(key, (None, None, None))[2] == composite:
            return
        with self._lock:
            self._decisions[key] = LegacyDecision(function, stack, composite, reason)
            while len(self._decisions) > self.decision_limit:
                self._decisions.popitem(last=False)

    def decisions(self) -> list[LegacyDecision]:
        with self._lock:
            return list(self._decisions.values())

    def clear(self) -> None:
        with self._lock:
            self._decisions.clear()
            self._looped.clear()
            self._looped_backward.clear()

    # -- choosing ------------------------------------------------------------------------------------------------

    def choose(self, cls: type) -> LegacyDecision:
        stack = tuple(name for name, _ in functorch_stack())
        key = (cls, stack)
        decision = self._decisions.get(key)
        if decision is not None:
            return decision
        decision = LegacyDecision(cls.__qualname__, format_stack(stack), *self._composite(cls, stack))
        with self._lock:
            self._decisions[key] = decision
            while len(self._decisions) > self.decision_limit:
                self._decisions.popitem(last=False)
        return decision

    def _composite(self, cls: type, stack: tuple[str, ...]) -> tuple[str, str]:
        if cls in self._direct:
            return self._direct[cls][1], self._direct[cls][2]
        has_backward = cls.backward is not _BASE_BACKWARD or cls.vjp is not _BASE_BACKWARD
        has_jvp = cls.jvp is not _BASE_JVP
        if "jvp" in stack and not has_jvp:
            hidden = _NOT_DIFFERENTIABLE & set(getattr(cls.forward, "__code__", _NO_CODE).co_names)
            if hidden:
                raise LegacyFunctionError(
                    f"multicomposite: {cls.__qualname__} under {format_stack(stack)}: forward-mode AD needs a jvp, "
                    f"which it does not define, and its forward's ops cannot be differentiated instead (it uses "
                    f"{', '.join(sorted(hidden))}, which autograd does not see). Define jvp(ctx, *tangents) (and "
                    "save_for_forward what it needs), or use a reverse-mode transform (jacrev, grad).")
            return "autograd", ("forward-mode AD is on the stack and the Function defines no jvp: its forward's ops "
                                "are differentiated")
        if "vmap" in stack and "mark_dirty" in getattr(cls.forward, "__code__", _NO_CODE).co_names:
            return "autograd", ("it modifies an input in place (mark_dirty) under vmap, where functorch's generated "
                                "vmap rule loses the modified input's identity: its forward's ops are differentiated")
        if "grad" in stack and not has_backward:
            return "autograd", "the Function defines no backward: its forward's ops are differentiated"
        backward = cls.vjp if cls.vjp is not _BASE_BACKWARD else cls.backward
        if stack.count("grad") >= 2 and getattr(backward, "__code__", None) is _ONCE_DIFFERENTIABLE_CODE:
            return "autograd", ("two reverse-mode levels and a once_differentiable backward: its forward's ops are "
                                "differentiated")
        return "adapted", "its own forward and backward, adapted to setup_context"

    # -- running -------------------------------------------------------------------------------------------------

    def apply(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _below_functorch():
            # A dispatcher kernel applies it (a torch.library custom op's autograd kernel): the transform levels
            # are already being processed, so it records at the level the dispatcher is at, as an aten op's
            # autograd kernel does, and as PyTorch's own apply does outside transforms.
            self.record(cls.__qualname__, format_stack(name for name, _ in functorch_stack()), "autograd kernel",
                        "applied by a dispatcher kernel below the transforms: recorded as an autograd node there")
            with enable_single_level_autograd_function():
                return super(Function, cls).apply(*unwrap_dead_wrappers(args), **kwargs)  # type: ignore[misc]
        decision = self.choose(cls)
        if cls in self._direct:
            return self._direct[cls][0](*args, **kwargs)
        needs = tuple(isinstance(a, torch.Tensor) and _needs_grad(a) for a in args)
        if decision.composite == "autograd":
            return self._through_forward(cls, args, kwargs, needs)
        batched, looped = self.adapted(cls)
        stack = decision.stack
        if cls in self._looped or "vmap" not in stack:
            return self._run(cls, looped if cls in self._looped else batched, args, kwargs, needs, stack)
        state = random_state.save()
        try:
            return self._run(cls, batched, args, kwargs, needs, stack)
        except RuntimeError as error:
            failure = error
        # Not batchable: its vmap rule becomes a loop over the samples, from the same random state.
        random_state.restore(state)
        try:
            result = self._run(cls, looped, args, kwargs, needs, stack)
        except LegacyFunctionError:
            raise
        except RuntimeError as retry:
            raise retry from failure
        self._looped.add(cls)
        return result

    def _run(self, cls: type, adapted: type, args: tuple[Any, ...], kwargs: dict[str, Any],
             needs: tuple[bool, ...], stack: str) -> Any:
        call = _Call(needs, stack)
        calls = self._local.calls
        calls.append(call)
        try:
            result = pytorch_apply(adapted, *args, **kwargs)
        finally:
            calls.pop()
        record = call.record
        if record is None:
            raise RuntimeError(f"multicomposite: the adapted {cls.__qualname__} ran no forward; report this bug")
        outputs = result if isinstance(result, tuple) else (result,)
        outputs = outputs[:record.outputs]
        return outputs[0] if record.single else tuple(outputs)

    def _through_forward(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any],
                         needs: tuple[bool, ...]) -> Any:
        ctx = _RecordingCtx(needs)
        result = cls.forward(ctx, *args, **kwargs)
        frozen = {id(t) for t in ctx._mc_state["non_differentiable"]}
        if not frozen:
            return result
        if isinstance(result, tuple):
            return tuple(r.detach() if id(r) in frozen else r for r in result)
        return result.detach() if id(result) in frozen else result

    def adapted(self, cls: type) -> tuple[type, type]:
        """The generated new-style classes of ``cls``: with the generated vmap rule, and with a looping one."""
        found = self._adapted.get(cls)
        if found is None:
            with self._lock:
                found = self._adapted.get(cls)
                if found is None:
                    batched = self._generate(cls)
                    found = self._adapted[cls] = (batched, self._looping(cls, batched))
        return found

    def _batched_or_looped(self, cls: type, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``fn(*args)`` (a backward); at a vmap level where it is not batchable (``jacrev`` vmaps the backward over
        the cotangents), once per sample (remembered per class)."""
        vmap = _vmap_level()
        if vmap is None:
            try:
                return fn(*args)
            except RuntimeError as error:
                stack = format_stack(name for name, _ in functorch_stack())
                if "vmap" not in stack and cls not in self._looped:
                    raise
                raise LegacyFunctionError(
                    f"multicomposite: the backward of {cls.__qualname__} failed under {stack} ({error}); at a gradient "
                    "level above a vmap level (or of a Function looped over a vmap's samples) its backward cannot be "
                    "looped per sample. Give the Function a setup_context and a vmap staticmethod, or make its "
                    "backward batchable (torch ops instead of NumPy, item() or data_ptr).") from error
        if cls not in self._looped_backward:
            try:
                return fn(*args)
            except RuntimeError:
                self._looped_backward.add(cls)
        return _per_sample(fn, args, *vmap)

    def _looping(self, cls: type, batched: type) -> type:
        """``batched`` with a vmap rule that applies it once per sample at the level below."""
        local = self._local

        writes = _writes_inputs(cls)

        def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
            results = []
            records = []
            for b in range(info.batch_size):
                sample = tuple(_own(a, writes) if d is None else a.select(d, b)
                               for a, d in zip(args, in_dims, strict=True))
                results.append(pytorch_apply(looped, *sample))
                records.append(local.calls[-1].record)
            _check_same_constants(cls, records, local.calls[-1].stack)
            outputs = []
            out_dims = []
            for column in zip(*results, strict=True):
                if isinstance(column[0], torch.Tensor):
                    outputs.append(torch.stack(column))
                    out_dims.append(0)
                else:
                    outputs.append(column[0])
                    out_dims.append(None)
            return tuple(outputs), tuple(out_dims)

        namespace = dict(vars(batched))
        for name in ("__dict__", "__weakref__", "_backward_cls", "generate_vmap_rule"):
            namespace.pop(name, None)
        namespace["vmap"] = staticmethod(vmap)
        namespace["__qualname__"] = f"{cls.__qualname__}Looped"
        looped = type(f"{cls.__name__}Looped", (Function,), namespace)
        return looped

    def _generate(self, cls: type) -> type:
        adapter = self
        local = self._local
        has_jvp = cls.jvp is not _BASE_JVP
        backward_fn = cls.vjp if cls.vjp is not _BASE_BACKWARD else cls.backward

        def run_forward(*args: Any) -> tuple[Any, ...]:
            call = local.calls[-1]
            ctx = _RecordingCtx(call.needs_input_grad)
            result = cls.forward(ctx, *args)
            record, extras = _record(ctx, args, result)
            if call.record is None or call.record.extras == record.extras:
                call.record = record
            outputs = (result,) if record.single else tuple(result)
            return (*outputs, *extras)

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
            record = local.calls[-1].record
            if record is None:
                raise RuntimeError(f"multicomposite: setup_context of {cls.__qualname__} before its forward")
            _replay(ctx, record, inputs, output, has_jvp)

        def backward(ctx: Any, *grads: Any) -> Any:
            layout: _Layout = ctx._mc_layout
            saved = tuple(ctx.saved_tensors)
            count = len(saved)

            def run(*flat: Any) -> Any:
                # The saved tensors travel with the gradients: a per-sample run slices both.
                return backward_fn(_BackwardCtx(ctx, layout, flat[:count], forward=False), *flat[count:])

            return adapter._batched_or_looped(cls, run, (*saved, *grads[:layout.outputs]))

        def jvp(ctx: Any, *tangents: Any) -> Any:
            layout: _Layout = ctx._mc_layout
            view = _BackwardCtx(ctx, layout, tuple(ctx.saved_tensors), forward=True)
            result = cls.jvp(view, *tangents)
            outputs = (result,) if not isinstance(result, tuple) else tuple(result)
            return (*outputs, *([None] * layout.extras))

        namespace: dict[str, Any] = {
            "forward": staticmethod(run_forward), "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward), "__module__": cls.__module__,
            "__qualname__": f"{cls.__qualname__}Adapted", "__doc__": f"{cls.__qualname__}, adapted to setup_context.",
        }
        if has_jvp:
            namespace["jvp"] = staticmethod(jvp)
        if cls.vmap is not _BASE_VMAP:  # its own vmap rule
            namespace["vmap"] = staticmethod(cls.vmap)
        else:
            namespace["generate_vmap_rule"] = True
        return type(f"{cls.__name__}Adapted", (Function,), namespace)


def _writes_inputs(cls: type) -> bool:
    """Whether the old forward may write into its inputs (an in-place method, ``.data``, ``mark_dirty``): looping
    over samples, each sample then gets its own copy of an input the samples share."""
    names = getattr(cls.forward, "__code__", _NO_CODE).co_names
    return any(name in ("data", "mark_dirty") or (name.endswith("_") and not name.startswith("__")) for name in names)


def _own(value: Any, writes: bool) -> Any:
    return value.clone() if writes and isinstance(value, torch.Tensor) else value


def _needs_grad(tensor: torch.Tensor) -> bool:
    """Whether some level differentiates ``tensor``: it requires grad itself or under one of its functorch wrappers
    (a batched tensor hides the gradient tracking of the level below it)."""
    while True:
        if tensor.requires_grad:
            return True
        if not (is_batchedtensor(tensor) or is_gradtrackingtensor(tensor)):
            return False
        tensor = get_unwrapped(tensor)


class LegacyFunctionError(RuntimeError):
    """A pre-2.0 Function that cannot run under this stack even adapted; the message says why and what to do."""


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return a is b


def _check_same_constants(cls: type, records: list[_Record | None], stack: str) -> None:
    """Looping over the samples, each forward kept its own ctx values; a reverse- or forward-mode level inside the
    vmap replays one ctx for the whole batch, which is wrong where the samples' values differ."""
    names = stack.replace(")", "").split("(")
    inner = names[names.index("vmap") + 1:] if "vmap" in names else []
    if not any(name in ("grad", "jvp") for name in inner):
        return
    first = records[0]
    differing = sorted({name for record in records[1:] if record is not None and first is not None
                        for name, value in record.constants.items()
                        if not _same(value, first.constants.get(name))})
    if differing:
        raise LegacyFunctionError(
            f"multicomposite: {cls.__qualname__} is not batchable (its forward failed under vmap), so it runs once "
            f"per sample, and the values its forward keeps on ctx ({', '.join(differing)}) differ between samples; "
            f"under {stack} a differentiating level inside the vmap would replay one sample's values for all. Give "
            "it a setup_context (and a vmap staticmethod), or take that gradient per sample outside vmap.")


def _replay(ctx: Any, record: _Record, inputs: tuple[Any, ...], output: tuple[Any, ...], has_jvp: bool) -> None:
    """Do onto a level's ``ctx`` what the old forward did onto its stand-in, with this level's tensors."""
    outputs = output if isinstance(output, tuple) else (output,)
    user_outputs = outputs[:record.outputs]
    extras = outputs[record.outputs:]

    def tensor(slot: _Slot) -> torch.Tensor:
        kind, index = slot
        return inputs[index] if kind == _INPUT else user_outputs[index] if kind == _OUTPUT else extras[index]

    combined: list[torch.Tensor] = []
    saved_none: list[int] = []
    for position, slot in enumerate(record.saved or ()):
        if slot is None:
            saved_none.append(position)
        else:
            combined.append(tensor(slot))
    saved_count = len(combined)
    start = len(combined)
    combined.extend(tensor(slot) for slot in record.saved_forward or () if slot is not None)
    forward_range = (start, len(combined))
    tensor_attributes: dict[str, tuple[pytree.TreeSpec, list[Any]]] = {}
    for name, (spec, leaves) in record.tensor_attributes.items():
        replayed = []
        for leaf in leaves:
            if leaf[0] == "slot":
                replayed.append(("saved", len(combined)))
                combined.append(tensor(leaf[1]))
            else:
                replayed.append(leaf)
        tensor_attributes[name] = (spec, replayed)
    # One save: under vmap each save call records the batch dimensions of its own tensors only.
    if combined:
        if has_jvp:
            ctx.save_for_forward(*combined)
        ctx.save_for_backward(*combined)
    if record.dirty:
        ctx.mark_dirty(*(tensor(slot) for slot in record.dirty))
    frozen = [tensor(slot) for slot in record.non_differentiable]
    frozen.extend(extras)
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    if record.materialize is not None:
        ctx.set_materialize_grads(record.materialize)
    for name, value in record.constants.items():
        setattr(ctx, name, value)
    ctx._mc_layout = _Layout(saved=saved_count, saved_forward=forward_range, tensor_attributes=tensor_attributes,
                             outputs=record.outputs, extras=record.extras, saved_none=tuple(saved_none))


class LegacyFunctionsPatch:
    """``Function.apply``'s patch (``registry.core.patches.Patch``) and the adapter it runs pre-2.0 Functions
    through: ``install`` swaps the code of PyTorch's ``apply`` for the one that asks this patch first,
    ``uninstall`` puts PyTorch's code back."""

    def __init__(self) -> None:
        self.adapter = LegacyFunctions()
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed

    def apply(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``Function.apply`` inside ``use()``: a pre-2.0 Function under a transform runs through the adapter."""
        active = self.active
        if (cls.setup_context is _BASE_SETUP_CONTEXT and _transforms_active() and active is not None and active()
                and not torch.compiler.is_compiling()):
            return self.adapter.apply(cls, args, kwargs)
        return pytorch_apply(cls, *args, **kwargs)

    def install(self, active: Callable[[], bool]) -> None:
        """Patch ``Function.apply``; ``active()``: whether this thread is inside ``use()`` with a policy that
        routes. Elsewhere it runs PyTorch's own code after one check."""
        with self.lock:
            self.active = active
            Function._multicomposite_apply = staticmethod(self.apply)  # type: ignore[attr-defined]
            _APPLY_FUNCTION.__code__ = _patched_apply_code()

    def uninstall(self) -> None:
        """Put PyTorch's own ``Function.apply`` back."""
        with self.lock:
            _APPLY_FUNCTION.__code__ = PYTORCH_APPLY_CODE
            self.active = None


def _patched_apply_code() -> types.CodeType:
    """The code ``Function.apply`` runs while installed. It replaces the code of PyTorch's function itself, not the
    class attribute: ``MyFunction.apply`` bound before ``use()`` (``rbf = RadialBasis.apply`` at import, the common
    way) calls that same function. Its one free variable is ``__class__`` (Function), as in PyTorch's code, whose
    closure it keeps; ``Function._multicomposite_apply`` is the hook it calls."""
    __class__ = Function  # the free variable the code shares with PyTorch's

    def apply(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        return __class__._multicomposite_apply(cls, args, kwargs)

    return apply.__code__


# The default registry's (``Router.patches``).
PATCH = LegacyFunctionsPatch()


def decisions() -> list[LegacyDecision]:
    """Each (Function, stack) seen inside ``use()`` with the composite chosen and why, oldest first."""
    return PATCH.adapter.decisions()
