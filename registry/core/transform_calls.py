"""torch.func's ``vmap`` and ``grad`` with less Python around each call, inside ``use()``.

NOTE [transform calls]: a per-sample-gradient step (``vmap(grad(loss))(params, x, y)``) pays functorch's Python
around the function at every call: pytree flattens and maps of the arguments (about twenty for one call, each a
walk in Python that builds ``TreeSpec`` objects), a context manager per level, per differentiable input and per
hook state, ``functools.partial`` wrappers, the output's flatten, broadcast of ``out_dims`` and unflatten. Measured
on a 2-core x86_64, one thread: ``vmap(grad(f))`` of a function that sums one of six parameters costs 0.33 ms, as
much as an MLP's whole batched training step at batch 4 (0.25 ms); in the per-sample steps of ``bench.models`` at
batch 4 it is 0.17-0.30 ms of 0.6-4 ms.

Inside ``use()`` this module's ``vmap_impl`` and ``grad_and_value_impl`` take the place of functorch's (the
attributes ``torch.func.vmap``'s and ``grad``'s wrappers look up at each call, so every ``vmap`` and ``grad`` made at
any time is served). They do what functorch's do, in the same order, with the same C++ calls
(``_vmap_increment_nesting``, ``_add_batch_dim``, ``_wrap_for_grad``, ``requires_grad_``, functorch's
``_autograd_grad``, ``_unwrap_for_grad``, ``_remove_batch_dim``) and the same result objects: PyTorch's
``TreeSpec`` where functorch hands one on (the level runner, ``_flat_vmap``, is called as functorch calls it, so
automatic functionalization still wraps it), and containers of the same types, keys and order. What they skip is
the generic part: arguments and results made of plain ``tuple``, ``list`` and ``dict`` containers (not subclasses:
named tuples, ``OrderedDict``; string keys) and leaves of types pytree does not register are walked once by a small
recursive function, and the structure found is the key of a bounded cache of PyTorch's ``TreeSpec`` objects.

Anything else goes to functorch's own implementation before anything has run: another container type, ``in_dims``
or ``out_dims`` other than an int or a flat tuple of ints and ``None``, ``chunk_size``, keyword arguments to grad,
an argument functorch would refuse (so its error is PyTorch's own, word for word), ``torch.compile`` tracing.
Outside ``use()`` PyTorch's run as they are.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import torch
import torch._functorch.apis as functorch_apis  # noqa: PLC2701 - functorch's internals have no public API
import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - functorch's internals have no public API
import torch._functorch.vmap as functorch_vmap  # noqa: PLC2701 - functorch's internals have no public API
from torch._C._functorch import (  # noqa: PLC2701 - functorch's internals have no public API
    _add_batch_dim,
    _grad_decrement_nesting,
    _grad_increment_nesting,
    _remove_batch_dim,
    _unwrap_for_grad,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
    _wrap_for_grad,
    get_inplace_requires_grad_allowed,
    set_inplace_requires_grad_allowed,
)
from torch.utils import _pytree as pytree  # noqa: PLC2701 - the TreeSpec functorch hands on is pytree's

PYTORCH_VMAP_IMPL = functorch_apis.vmap_impl
PYTORCH_GRAD_AND_VALUE_IMPL = eager_transforms.grad_and_value_impl
PYTORCH_FLAT_VMAP = functorch_vmap._flat_vmap  # functionalization.py's too

# grad_and_value_impl's decorator (doesnt_support_saved_tensors_hooks) says this while grad runs.
SAVED_TENSORS_HOOKS_MESSAGE = ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. "
                               "Please open an issue with your use case.")
_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_  # PyTorch's own (checkpointing.py patches the Python attribute)
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_saved_hooks = torch._C._autograd

# The structure keys: a leaf (None among them: pytree's Python implementation registers no node for it), and one
# tuple per container.
_LEAF, _TUPLE, _LIST, _DICT = 0, 1, 2, 3


class UnsupportedError(Exception):
    """A structure or argument the lean path leaves to functorch's implementation (never leaves this module)."""


def _walk(obj: Any, leaves: list[Any]) -> Hashable:
    """The structure key of ``obj``, appending its leaves in pytree's order; ``UnsupportedError`` where pytree's walk
    could differ (a registered node type other than the three plain containers, a subclass of one)."""
    kind = type(obj)
    if kind is tuple:
        return (_TUPLE, *[_walk(item, leaves) for item in obj])
    if kind is list:
        return (_LIST, *[_walk(item, leaves) for item in obj])
    if kind is dict:
        keys = tuple(obj)
        if not all(type(name) is str for name in keys):
            raise UnsupportedError  # 1 and True are one cache key and two dicts
        return (_DICT, keys, *[_walk(value, leaves) for value in obj.values()])
    if isinstance(obj, (tuple, list, dict)) or kind in pytree.SUPPORTED_NODES:
        raise UnsupportedError
    leaves.append(obj)
    return _LEAF


def _build(key: Any, leaves: Iterator[Any]) -> Any:
    """The structure ``key`` describes, its leaves taken from ``leaves`` in order (the inverse of ``_walk``)."""
    if key == _LEAF:
        return next(leaves)
    if key[0] == _DICT:
        return {name: _build(child, leaves) for name, child in zip(key[1], key[2:], strict=True)}
    items = [_build(child, leaves) for child in key[1:]]
    return tuple(items) if key[0] == _TUPLE else items


class _Specs:
    """PyTorch's TreeSpec of each structure key the lean path has met, and the key of each such spec (by identity),
    at most ``limit`` of each: all forgotten at once past it (a program meets a handful)."""

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self.by_key: dict[Hashable, pytree.TreeSpec] = {}
        self.keys: dict[int, tuple[pytree.TreeSpec, Hashable]] = {}  # the spec held: its id is not reused meanwhile

    def spec(self, key: Hashable) -> pytree.TreeSpec:
        """The TreeSpec of the structure ``key`` describes (pytree's own flatten of a stand-in; leaves' values do not
        enter a spec)."""
        found = self.by_key.get(key)
        if found is None:
            if len(self.by_key) >= self.limit:
                self.by_key.clear()
                self.keys.clear()
            found = self.by_key[key] = pytree.tree_flatten(_build(key, itertools.repeat(0)))[1]
            self.keys[id(found)] = (found, key)
        return found

    def key(self, spec: Any) -> Hashable | None:
        """The structure key ``spec`` was made for here; None for a spec made elsewhere (functorch's, a split's)."""
        entry = self.keys.get(id(spec))
        return entry[1] if entry is not None and entry[0] is spec else None


_SPECS = _Specs()
_spec = _SPECS.spec


def flatten(obj: Any) -> tuple[list[Any], Hashable]:
    """``obj``'s leaves in pytree's order and its structure key; ``UnsupportedError`` where pytree's walk could
    differ."""
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves)


def flatten_arguments(args: tuple[Any, ...]) -> tuple[list[Any], list[Hashable], list[int]]:
    """The leaves of all of ``args`` in pytree's order, each argument's structure key, and where each argument's
    leaves start (one more entry: where the last one's end)."""
    leaves: list[Any] = []
    keys, bounds = [], [0]
    for arg in args:
        keys.append(_walk(arg, leaves))
        bounds.append(len(leaves))
    return leaves, keys, bounds


class TransformCalls:
    """The patch of functorch's ``vmap_impl`` and ``grad_and_value_impl`` (``registry.core.patches.Patch``), and the
    lean level runner automatic functionalization calls in place of ``_flat_vmap``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        # Off: functorch's own implementations inside use() too (bench.transform_calls' baseline).
        self.enabled = True

    def install(self, active: Callable[[], bool]) -> None:
        with self.lock:
            self.active = active
            functorch_apis.vmap_impl = self.vmap_impl
            eager_transforms.grad_and_value_impl = self.grad_and_value_impl

    def uninstall(self) -> None:
        with self.lock:  # where the attributes are what we left there (patches after us are uninstalled already)
            if functorch_apis.vmap_impl == self.vmap_impl:
                functorch_apis.vmap_impl = PYTORCH_VMAP_IMPL
            if eager_transforms.grad_and_value_impl == self.grad_and_value_impl:
                eager_transforms.grad_and_value_impl = PYTORCH_GRAD_AND_VALUE_IMPL
            self.active = None

    def routes(self) -> bool:
        """Whether this call takes the lean path: installed, enabled, inside use() on this thread, not traced."""
        if torch.compiler.is_compiling():  # first: Dynamo traces vmap's Python, and cannot trace active()
            return False
        active = self.active
        return self.enabled and active is not None and active()

    # --- vmap -----------------------------------------------------------------------------------------------------

    def vmap_impl(self, func: Callable[..., Any], in_dims: Any, out_dims: Any, randomness: str,
                  chunk_size: int | None, *args: Any, **kwargs: Any) -> Any:
        """functorch's ``vmap_impl``: its checks of the arguments against ``in_dims``, then its level runner
        (``_flat_vmap``, automatic functionalization's where installed) with PyTorch's TreeSpec of the arguments."""
        if chunk_size is None and type(out_dims) is int and self.routes():
            try:
                batch_size, flat_in_dims, flat_args, key = _batched_inputs(in_dims, args)
            except UnsupportedError:
                pass
            else:
                functorch_vmap.lazy_load_decompositions()
                return functorch_vmap._flat_vmap(func, batch_size, flat_in_dims, flat_args, _spec(key), out_dims,
                                                 randomness, **kwargs)
        return PYTORCH_VMAP_IMPL(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)

    def flat_vmap(self, func: Callable[..., Any], batch_size: int, flat_in_dims: list[int | None],
                  flat_args: list[Any], args_spec: pytree.TreeSpec, out_dims: Any, randomness: str,
                  **kwargs: Any) -> Any:
        """functorch's ``_flat_vmap`` (what automatic functionalization runs a level with): the same level, the
        results unwrapped without pytree where they are plain containers of tensors and ``out_dims`` an int."""
        if not self.enabled or type(out_dims) is not int:
            return PYTORCH_FLAT_VMAP(func, batch_size, flat_in_dims, flat_args, args_spec, out_dims, randomness,
                                     **kwargs)
        level = _vmap_increment_nesting(batch_size, randomness)
        try:
            batched = [arg if in_dim is None else _add_batch_dim(arg, in_dim, level)
                       for in_dim, arg in zip(flat_in_dims, flat_args, strict=True)]
            # The arguments rebuilt from the structure the spec was made for, where it was made here (pytree's
            # unflatten walks the spec in Python, about 2 us a node).
            args_key = _SPECS.key(args_spec)
            outputs = func(*(pytree.tree_unflatten(batched, args_spec) if args_key is None
                             else _build(args_key, iter(batched))), **kwargs)
            try:
                leaves, key = flatten(outputs)
            except UnsupportedError:
                return functorch_vmap._unwrap_batched(outputs, out_dims, level, batch_size, func)
            if key == _LEAF:  # a lone output: functorch's own unwrap (its edge cases and messages)
                return functorch_vmap._unwrap_batched(outputs, out_dims, level, batch_size, func)
            unwrapped = [_remove_batch_dim(leaf, level, batch_size, out_dims) if isinstance(leaf, torch.Tensor)
                         else functorch_vmap._maybe_remove_batch_dim(functorch_vmap._get_name(func), leaf, level,
                                                                     batch_size, out_dims)
                         for leaf in leaves]
            return _build(key, iter(unwrapped))
        finally:
            _vmap_decrement_nesting()

    # --- grad -----------------------------------------------------------------------------------------------------

    def grad_and_value_impl(self, func: Callable[..., Any], argnums: Any, has_aux: bool, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """functorch's ``grad_and_value_impl`` (grad's and grad_and_value's), step for step."""
        if kwargs or not self.routes():
            return PYTORCH_GRAD_AND_VALUE_IMPL(func, argnums, has_aux, args, kwargs)
        try:
            positions = _argnums(argnums, len(args))
            leaves, keys, bounds = flatten_arguments(args)
        except UnsupportedError:
            return PYTORCH_GRAD_AND_VALUE_IMPL(func, argnums, has_aux, args, kwargs)
        differentiated = [range(bounds[i], bounds[i + 1]) for i in positions]
        if not all(isinstance(leaves[j], torch.Tensor) for span in differentiated for j in span):
            return PYTORCH_GRAD_AND_VALUE_IMPL(func, argnums, has_aux, args, kwargs)  # its error, word for word
        diff_key = keys[positions[0]] if type(argnums) is int else (_TUPLE, *[keys[i] for i in positions])
        plan = _GradPlan(leaves, (_TUPLE, *keys), [j for span in differentiated for j in span], diff_key)
        # doesnt_support_saved_tensors_hooks, inlined (torch.autograd.graph.disable_saved_tensors_hooks)
        previous_message = _saved_hooks._saved_tensors_hooks_get_disabled_error_message()
        _saved_hooks._saved_tensors_hooks_disable(SAVED_TENSORS_HOOKS_MESSAGE)
        try:
            level = _grad_increment_nesting()
            try:
                return _grad_level(func, has_aux, plan, level)
            finally:
                _grad_decrement_nesting()
        finally:
            if previous_message is None:
                _saved_hooks._saved_tensors_hooks_enable()
            else:
                _saved_hooks._saved_tensors_hooks_disable(previous_message)


def _batched_inputs(in_dims: Any, args: tuple[Any, ...]) -> tuple[int, list[int | None], list[Any], Hashable]:
    """_process_batched_inputs for ``in_dims`` an int or a flat tuple (one int or None per argument): the batch
    size, each leaf's dimension (negative ones wrapped), the leaves, the structure key. ``UnsupportedError`` wherever
    functorch would raise (its own message then) or ``in_dims`` has another form."""
    if not args:
        raise UnsupportedError
    if type(in_dims) is int:
        per_argument: tuple[Any, ...] = (in_dims,) * len(args)
    elif type(in_dims) is tuple and len(in_dims) == len(args):
        per_argument = in_dims
    else:
        raise UnsupportedError
    flat_args, keys, bounds = flatten_arguments(args)
    flat_in_dims: list[int | None] = []
    batch_size = None
    for position, in_dim in enumerate(per_argument):
        start, end = bounds[position], bounds[position + 1]
        if in_dim is None:
            flat_in_dims.extend([None] * (end - start))
            continue
        if type(in_dim) is not int:
            raise UnsupportedError
        for leaf in flat_args[start:end]:
            if not isinstance(leaf, torch.Tensor) or not -leaf.dim() <= in_dim < leaf.dim():
                raise UnsupportedError
            dim = in_dim % leaf.dim()
            size = leaf.size(dim)
            if batch_size is None:
                batch_size = size
            elif size != batch_size:
                raise UnsupportedError
            flat_in_dims.append(dim)
    if batch_size is None:
        raise UnsupportedError
    return batch_size, flat_in_dims, flat_args, (_TUPLE, *keys)


def _argnums(argnums: Any, count: int) -> tuple[int, ...]:
    """_slice_argnums' positions: an int or a tuple of distinct ints, each in range (negative ones wrapped)."""
    if type(argnums) is int:
        numbers: tuple[Any, ...] = (argnums,)
    elif type(argnums) is tuple and argnums:
        numbers = argnums
    else:
        raise UnsupportedError
    if not all(type(n) is int and -count <= n < count for n in numbers):
        raise UnsupportedError
    positions = tuple(n % count for n in numbers)
    if len(set(positions)) != len(positions):
        raise UnsupportedError
    return positions


class _GradPlan(NamedTuple):
    """One grad call's arguments as walked once: their leaves, the structure of all of them, the positions of the
    differentiated leaves among them, and the structure of what is differentiated (of the gradients)."""

    leaves: list[Any]
    key: Hashable
    differentiated: list[int]
    diff_key: Hashable


def _grad_level(func: Callable[..., Any], has_aux: bool, plan: _GradPlan, level: int) -> tuple[Any, Any]:
    """grad_and_value_impl's body inside its level, from ``torch.enable_grad()`` on (its NOTE [grad and vjp
    interaction with no_grad])."""
    was_enabled = _is_grad_enabled()
    _set_grad_enabled(True)
    try:
        wrapped = [_wrap_for_grad(leaf, level) if isinstance(leaf, torch.Tensor) else leaf for leaf in plan.leaves]
        args = _build(plan.key, iter(wrapped))
        flat_diff_args = [wrapped[j] for j in plan.differentiated]
        allowed = get_inplace_requires_grad_allowed()
        set_inplace_requires_grad_allowed(True)
        try:
            for tensor in flat_diff_args:
                _REQUIRES_GRAD_(tensor)
        finally:
            set_inplace_requires_grad_allowed(allowed)

        output = func(*args)
        aux = None
        if has_aux:
            if not (isinstance(output, tuple) and len(output) == 2):
                raise RuntimeError("grad_and_value(f)(*args): output of function f should be a tuple: (output, aux) "
                                   "if has_aux is True")
            output, aux = output
        if not isinstance(output, torch.Tensor):
            raise RuntimeError(f"grad_and_value(f)(*args): Expected f(*args) to return a Tensor, got {type(output)}")
        if output.dim() != 0:
            raise RuntimeError("grad_and_value(f)(*args): Expected f(*args) to return a scalar Tensor, got tensor "
                               f"with {output.dim()} dims. Maybe you wanted to use the vjp or jacrev APIs instead?")
        # NB (functorch's): create_graph so that the backward pass isn't run in no_grad mode; first_order_grad.py's
        # patch of _autograd_grad, looked up here as functorch looks it up, drops it where nothing can record.
        flat_grads = eager_transforms._autograd_grad((output,), flat_diff_args, create_graph=True)
        grad_input = _build(plan.diff_key, iter([_unwrap_for_grad(g, level) for g in flat_grads]))
        output = _unwrap_for_grad(output, level)
        if has_aux:
            return grad_input, (output, eager_transforms._undo_create_differentiable(aux, level))
        return grad_input, output
    finally:
        _set_grad_enabled(was_enabled)


PATCH = TransformCalls()
