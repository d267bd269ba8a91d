"""Activation checkpointing (``torch.utils.checkpoint``) under torch.func transforms inside ``use()``.

Both forms fail under transforms natively: the reentrant one (``use_reentrant=True``) is a pre-2.0 Function
(``CheckpointFunction``), which every transform refuses; the non-reentrant one recomputes through saved-tensor
hooks, which grad, vjp, jacrev and hessian disable ("torch.func transforms don't yet support saved tensor hooks"),
and under vmap its recomputation runs after the vmap level has exited, on tensors that escaped it.

Inside ``use()`` the checkpointed function is, by stack, either recomputed (PyTorch's own checkpoint) or run directly
with its activations kept, which is the un-checkpointed program and so always has its values and gradients:

- a stack with a vmap or a grad level (vmap, grad, vmap(grad), jacrev, jacfwd, hessian): activations kept;
- a stack of jvp levels only (``torch.func.jvp``), where PyTorch's recomputation runs: recomputed, as natively.

The reentrant form's recomputation runs ``torch.autograd.backward`` inside its backward, which no functorch level
can run, so under every transform it keeps the activations. Each choice goes to the decision log
(``registry.core.legacy_functions.decisions()``). ``checkpoint_sequential`` calls ``checkpoint`` and follows it.

Model libraries that enable checkpointing also hook their input embeddings to call ``output.requires_grad_(True)``
(so that the reentrant form sees an input that requires grad), which every functorch transform refuses for a
tensor it wraps ("You are attempting to call Tensor.requires_grad_() ..."). Inside ``use()`` under a transform that
call does nothing on a wrapped tensor: a transform returns gradients for its own inputs only, which it tracks
already, so no result changes. ``requires_grad_(False)`` still raises, as natively.

Keeping activations costs what the un-checkpointed program costs: the memory checkpointing would have saved, and
none of the recomputation's time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
    get_inplace_requires_grad_allowed,
    maybe_get_level,
)

from registry.core import legacy_functions
from registry.core.context import functorch_stack
from registry.core.legacy_functions import LegacyFunctions
from registry.core.stacks import format_stack

PYTORCH_NON_REENTRANT = torch_checkpoint._checkpoint_without_reentrant_generator
PYTORCH_REQUIRES_GRAD_ = torch.Tensor.requires_grad_
NON_REENTRANT = "torch.utils.checkpoint (use_reentrant=False)"
KEEP = "keep activations"
RECOMPUTE = "recompute"
_KEEP_REASON = ("a vmap or grad level is on the stack, where PyTorch's recomputation cannot run (grad disables "
                "saved-tensor hooks; under vmap it runs after the level exits): the function runs directly")
_RECOMPUTE_REASON = "only jvp levels: PyTorch's recomputation runs"

def _run_directly(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
    """``CheckpointFunction.apply(function, preserve_rng_state, *args)`` with the activations kept."""
    return function(*args)


_DIRECT_REASON = ("torch.utils.checkpoint (use_reentrant=True): its backward recomputes through "
                  "torch.autograd.backward, which no functorch level can run; the function runs directly (activations "
                  "kept)")


class CheckpointingPatch:
    """Checkpointing's patch (``registry.core.patches.Patch``): the stack-choosing generator and ``requires_grad_``,
    put in place by ``install`` and PyTorch's own put back by ``uninstall``. The reentrant form goes through the
    legacy-Function adapter, whose decision log records the choices here too."""

    def __init__(self, adapter: LegacyFunctions) -> None:
        self.adapter = adapter
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        adapter.register_direct(torch_checkpoint.CheckpointFunction, _run_directly, _DIRECT_REASON)
        self.generator = _generator(self)
        self.requires_grad_ = _requires_grad(self)

    def keeps_activations(self) -> bool:
        """Inside ``use()`` under a stack where recomputation cannot run; logs the choice."""
        active = self.active
        if not torch._C._are_functorch_transforms_active() or active is None or not active():
            return False
        if torch.compiler.is_compiling():
            return False
        stack = tuple(name for name, _ in functorch_stack())
        keep = "vmap" in stack or "grad" in stack
        self.adapter.record(NON_REENTRANT, format_stack(stack), KEEP if keep else RECOMPUTE,
                            _KEEP_REASON if keep else _RECOMPUTE_REASON)
        return keep

    def install(self, active: Callable[[], bool]) -> None:
        with self.lock:
            self.active = active
            torch_checkpoint._checkpoint_without_reentrant_generator = self.generator
            torch.Tensor.requires_grad_ = self.requires_grad_  # type: ignore[method-assign]

    def uninstall(self) -> None:
        with self.lock:
            torch_checkpoint._checkpoint_without_reentrant_generator = PYTORCH_NON_REENTRANT
            torch.Tensor.requires_grad_ = PYTORCH_REQUIRES_GRAD_  # type: ignore[method-assign]
            self.active = None


def _generator(patch: CheckpointingPatch) -> Callable[..., Iterator[None]]:
    def _checkpoint_without_reentrant_generator(fn: Callable[..., Any], *args: Any, **kwargs: Any,
                                                ) -> Iterator[None]:
        """PyTorch's generator around the checkpointed call (``checkpoint`` runs ``fn`` between its two steps);
        where activations are kept, it does nothing around the call."""
        if patch.keeps_activations():
            yield
            return
        yield from PYTORCH_NON_REENTRANT(fn, *args, **kwargs)

    return _checkpoint_without_reentrant_generator


def _requires_grad(patch: CheckpointingPatch) -> Callable[..., torch.Tensor]:
    """``Tensor.requires_grad_`` as a plain function (a class attribute, so a bound method would not bind ``self``)."""

    def requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        """``Tensor.requires_grad_``; inside ``use()`` under a transform, ``True`` on a tensor a transform wraps
        does nothing (PyTorch refuses the call there)."""
        # functorch's own calls (grad marking its inputs, once per input of every grad call) are allowed, and asked
        # first: only the user's, which it refuses, do nothing.
        active = patch.active
        if (requires_grad and not get_inplace_requires_grad_allowed() and active is not None
                and torch._C._are_functorch_transforms_active() and active() and not torch.compiler.is_compiling()
                and maybe_get_level(self) != -1):
            return self
        return PYTORCH_REQUIRES_GRAD_(self, requires_grad)

    requires_grad_.__doc__ = PYTORCH_REQUIRES_GRAD_.__doc__
    return requires_grad_


# The default registry's (``Router.patches``), logging into the default legacy-Function adapter.
PATCH = CheckpointingPatch(legacy_functions.PATCH.adapter)
