"""``torch.func.functional_call`` with less Python per call, inside ``use()``.

NOTE [functional calls]: a per-sample-gradient step calls the model through ``functional_call`` once per step (under
``vmap(grad)`` the function runs once, at the logical sample). PyTorch's ``_functional_call`` (what
``torch.func.functional_call`` and the deprecated ``torch.nn.utils.stateless.functional_call`` call) walks the module
tree twice before the model runs: ``_untie_named_tensors_map`` lists every parameter and buffer by every name it has
(``named_parameters(remove_duplicate=False)``, a generator per module and level) to find the tied ones, and a
``NamedMemberAccessor`` finds each given name's module again by its path, then swaps, and swaps back after.
Measured on a 2-core x86_64, one thread: 26 us for the MLP of ``bench.models`` (six tensors, four modules) around a
forward of 31 us, out of a per-sample-gradient step of 0.56 ms at batch 4.

Inside ``use()`` this module's ``functional_call`` takes the place of ``_functional_call`` (the attribute both
callers look up at each call). It walks the tree once (each module's ``_parameters``, ``_buffers`` and ``_modules``,
as ``named_parameters`` does), and where no tensor has two names (nothing tied) and every given name is a parameter
or buffer found there, swaps each given tensor in with PyTorch's own ``swap_tensor`` on the module found, calls the
module, swaps back in the same order and writes what the module held at the end back into the caller's dict, as
``_reparametrize_module`` does. Everything else runs PyTorch's own, before anything is swapped: tied tensors (their
untying and its error), ``strict``, a name that is not a parameter or buffer (an attribute, a missing name), a value
that is not a tensor, a module class that lists its members its own way (``named_modules``, ``named_parameters``,
``named_buffers`` or ``_named_members`` overridden), JIT tracing and scripted modules, ``DataParallel``, a
``parameter_and_buffer_dicts`` that is not a dict. Outside ``use()`` PyTorch's runs as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless
from torch.nn.utils._named_member_accessor import swap_tensor  # noqa: PLC2701 - what PyTorch's own call swaps with

PYTORCH_FUNCTIONAL_CALL = stateless._functional_call

# What named_parameters and named_buffers go through; a class that overrides one lists its members its own way.
_LISTING = ("named_modules", "named_parameters", "named_buffers", "_named_members")
_MODULE_LISTING = tuple(getattr(nn.Module, name) for name in _LISTING)
_SCRIPTED = (torch.jit.RecursiveScriptModule, torch.jit.ScriptModule, torch.jit.ScriptFunction, nn.DataParallel)


class UnsupportedError(Exception):
    """A module or call the lean path leaves to PyTorch's ``_functional_call`` (never leaves this module)."""


# Where one given name lives: its module, the dict that holds it there (``_parameters`` or ``_buffers``), its key.
Holder = tuple[nn.Module, dict[str, Any], str]

# More modules than any model has: a module that is its own descendant (PyTorch's walk recurses until Python's limit).
_MOST_MODULES = 1 << 20


def _members(root: nn.Module, plain_classes: set[type]) -> tuple[dict[str, Holder], bool]:
    """Every parameter and buffer of ``root``'s tree by its path name, as ``named_parameters`` and ``named_buffers``
    (``remove_duplicate=False``) name them, and whether one tensor has two names (tied: a shared module lists its
    tensors under both paths). ``plain_classes``: the module classes known to list their members as ``nn.Module``
    does; ``UnsupportedError`` for one that does not."""
    holders: dict[str, Holder] = {}
    tensor_ids: set[int] = set()
    count = 0
    pending: list[tuple[nn.Module, str]] = [(root, "")]
    while pending:
        module, prefix = pending.pop()
        kind = type(module)
        if kind not in plain_classes:
            if any(getattr(kind, name) is not own for name, own in zip(_LISTING, _MODULE_LISTING, strict=True)):
                raise UnsupportedError
            plain_classes.add(kind)
        for members in (module._parameters, module._buffers):
            for name, tensor in members.items():
                if tensor is not None:
                    tensor_ids.add(id(tensor))
                    count += 1
                    holders[prefix + name] = (module, members, name)
        for name, child in module._modules.items():
            if child is not None:
                pending.append((child, prefix + name + "."))
        if count + len(pending) > _MOST_MODULES:
            raise UnsupportedError
    return holders, len(tensor_ids) != count


class FunctionalCalls:
    """The patch of ``torch.nn.utils.stateless._functional_call`` (``registry.core.patches.Patch``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        # Off: PyTorch's own inside use() too (bench.transform_calls' baseline).
        self.enabled = True
        # The module classes that list their members as nn.Module does (checked once per class).
        self.plain_classes: set[type] = set()

    def install(self, active: Callable[[], bool]) -> None:
        with self.lock:
            self.active = active
            stateless._functional_call = self.functional_call

    def uninstall(self) -> None:
        with self.lock:
            if stateless._functional_call == self.functional_call:
                stateless._functional_call = PYTORCH_FUNCTIONAL_CALL
            self.active = None

    def routes(self) -> bool:
        """Whether this call takes the lean path: installed, enabled, inside use() on this thread, not traced."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # Dynamo traces this Python; the JIT refuses
            return False
        active = self.active
        return self.enabled and active is not None and active()

    def functional_call(self, module: nn.Module, parameters_and_buffers: dict[str, torch.Tensor],
                        args: Any = None, kwargs: dict[str, Any] | None = None, *, tie_weights: bool = True,
                        strict: bool = False) -> Any:
        """PyTorch's ``_functional_call``: ``module`` called with ``parameters_and_buffers`` in place of its own."""
        if strict or not isinstance(parameters_and_buffers, dict) or isinstance(module, _SCRIPTED) or not (
                isinstance(module, nn.Module) and self.routes()):
            return PYTORCH_FUNCTIONAL_CALL(module, parameters_and_buffers, args, kwargs, tie_weights=tie_weights,
                                           strict=strict)
        try:
            swaps = self.swaps(module, parameters_and_buffers, tie_weights)
        except UnsupportedError:
            return PYTORCH_FUNCTIONAL_CALL(module, parameters_and_buffers, args, kwargs, tie_weights=tie_weights,
                                           strict=strict)
        if kwargs is None:
            kwargs = {}
        if args is None:
            args = ()
        elif not isinstance(args, tuple):
            args = (args,)
        # swap_tensor's steps for a name its module's _parameters or _buffers holds (each given name here).
        originals: list[tuple[str, Holder, torch.Tensor]] = []
        for name, holder in swaps:
            _, members, key = holder
            originals.append((name, holder, members[key]))
            members[key] = parameters_and_buffers[name]
        try:
            return module(*args, **kwargs)
        finally:
            held = {name: _swap_back(holder, original) for name, holder, original in originals}
            # What the module held at the end goes back into the caller's dict (a forward that reassigned one).
            parameters_and_buffers.update({name: held[name] for name in parameters_and_buffers if name in held})

    def swaps(self, module: nn.Module, parameters_and_buffers: dict[str, torch.Tensor],
              tie_weights: bool) -> list[tuple[str, Holder]]:
        """Each given name with where it lives; ``UnsupportedError`` where PyTorch's own call must run (the module's
        NOTE)."""
        holders, tied = _members(module, self.plain_classes)
        if tied and tie_weights:
            raise UnsupportedError
        swaps = []
        for name, tensor in parameters_and_buffers.items():
            holder = holders.get(name)
            if holder is None or not isinstance(tensor, torch.Tensor):
                raise UnsupportedError
            swaps.append((name, holder))
        return swaps


def _swap_back(holder: Holder, original: torch.Tensor) -> torch.Tensor:
    """``original`` back where it was; what was there. PyTorch's ``swap_tensor`` where the forward moved or removed
    the member (its rules for attributes and missing names)."""
    module, members, key = holder
    parameters = module._parameters
    if key in members and (members is parameters or (members is module._buffers and key not in parameters)):
        held = members[key]
        members[key] = original
        return held
    return swap_tensor(module, key, original, allow_missing=True)


PATCH = FunctionalCalls()
