"""torch.func.grad's backward without ``create_graph`` where nothing can differentiate its result again (inside
``use()``, C++ backend).

NOTE [first-order grad]: functorch's ``grad_and_value_impl`` always runs autograd with ``create_graph=True`` ("so
that backward pass isn't run in no_grad mode"): a level below it (an outer grad or jvp, eager autograd under every
transform) may differentiate the gradients again, and with ``create_graph=False`` the engine runs the backward under
no_grad, which every level below obeys (functorch's NOTE [grad and vjp interaction with no_grad]). The price is paid
wherever nothing does: every backward op is recorded at the grad level, PyTorch's nodes pick their
twice-differentiable formulas, and a weight used at T steps of a recurrence gets its T gradients summed out of place
(in place without ``create_graph``).

Inside ``use()``, functorch's ``_autograd_grad`` (what grad's implementation calls; ``vjp`` calls it with cotangents,
and is left alone) runs without ``create_graph`` exactly where nothing below the grad level can record:

- every level below it is a vmap level (no grad, jvp or functionalize level: ``vmap(grad)``, ``vmap(vmap(grad))``,
  ``grad`` alone),
- no differentiated output requires grad below the wrappers (eager autograd tracks nothing the forward touched: the
  parameters were detached, or the call runs under ``torch.no_grad()``), the graph behind them holds only
  PyTorch's built-in nodes, without hooks (a Python node's backward or a hook may use tensors the forward did not):
  ``kernels/first_order.cpp``, a walk of the graph in C++, and
- the batch is not empty (the first-order backward kernels' batching rules do not all take a vmap over no samples).

Everywhere else, outside ``use()`` and on the Python backend, PyTorch's ``_autograd_grad`` runs as it is.

NOTE [first-order engine call]: where the backward is first-order, ``_autograd_grad``'s Python around the engine is
about half of what a small backward costs (measured on a 2-core x86_64, one thread: 27 us for functorch's
``_autograd_grad`` of a one-node graph, 14 us for the engine's ``run_backward`` with the ones made as
``torch.autograd.grad`` makes them): ``torch.autograd.grad``'s argument normalization, ``_make_grads``' checks, the
override dispatch, the logging check, the compiled-autograd context and the context stash for device threads. So
``first_order_backward`` calls the engine as ``torch.autograd.grad`` does (``allow_unused``, no ``create_graph``, the
ones of ``_make_grads``, ``None`` gradients as functorch's zeros) where none of those can matter: every output a real
floating-point scalar that requires grad (any other: PyTorch's own, with its errors), no ``__torch_function__``
override, autograd's debug logging off, no compiled-autograd compiler set (functorch switches it off for this call;
one set: PyTorch's own). The context stash serves Python code that runs on the engine's device threads; the graph
check above admits no node that runs Python.

On the C++ backend that one engine call runs with grad's level set aside on the CPU (``kernels/first_order.cpp``'s NOTE
[first-order backward below the grad level]): nothing records at that level during a first-order backward, so each
op of each node skips grad's interpreter and costs what the vmap levels below cost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - functorch's internals have no public API
from torch.autograd import graph as autograd_graph

PYTORCH_AUTOGRAD_GRAD = eager_transforms._autograd_grad
_ENGINE = torch.autograd.Variable._execution_engine
_set_autograd_compiler = torch._C._dynamo.compiled_autograd.set_autograd_compiler
_has_torch_function = torch._C._has_torch_function


def first_order_backward(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                         below_grad: Callable[..., list[torch.Tensor | None]] | None = None,
                         ) -> tuple[torch.Tensor, ...] | None:
    """functorch's ``_autograd_grad`` without ``create_graph`` for ``outputs`` whose backward is first-order, as one
    call of the engine (NOTE [first-order engine call]); None where PyTorch's own must run. ``below_grad``: the
    compiled kernels' ``first_order_gradients``, which runs the engine with the grad level set aside
    (``kernels/first_order.cpp``'s NOTE [first-order backward below the grad level])."""
    outputs, inputs = tuple(outputs), tuple(inputs)
    if not inputs or _has_torch_function(outputs + inputs) or autograd_graph.log.isEnabledFor(logging.DEBUG):
        return None
    if not all(out.requires_grad and out.dtype.is_floating_point and out.numel() == 1 for out in outputs):
        return None
    ones = tuple(torch.ones_like(out, memory_format=torch.preserve_format) for out in outputs)  # _make_grads'
    prior = _set_autograd_compiler(None, False)
    try:
        if prior[0] is not None:
            return None
        if below_grad is not None:
            grads = below_grad(list(outputs), list(ones), list(inputs))
        else:
            grads = _ENGINE.run_backward(outputs, ones, False, False, inputs, True, False)
    finally:
        _set_autograd_compiler(*prior)
    return tuple(torch.zeros_like(inp) if grad is None else grad for grad, inp in zip(grads, inputs, strict=True))


class FirstOrderGrad:
    """The patch of functorch's ``_autograd_grad`` (``registry.core.patches.Patch`` and ``CompiledKernels``: the
    graph check is compiled with the routing kernels, so the C++ backend alone has it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: Callable[[], bool] | None = None  # whether this thread routes, while installed
        self.compiled: ModuleType | None = None  # the compiled routing kernels, while their Library exists
        # Off: grad keeps create_graph inside use() too (bench.first_order_grad's baseline).
        self.enabled = True
        # Off: a first-order backward goes through torch.autograd.grad too (bench.transform_calls' baseline).
        self.engine_call = True
        # Off: the first-order engine call runs with the grad level in place (bench.below_grad's baseline).
        self.below_grad = True

    def install(self, active: Callable[[], bool]) -> None:
        with self.lock:
            self.active = active
            if eager_transforms._autograd_grad is PYTORCH_AUTOGRAD_GRAD:
                eager_transforms._autograd_grad = self.autograd_grad

    def uninstall(self) -> None:
        with self.lock:
            if eager_transforms._autograd_grad == self.autograd_grad:
                eager_transforms._autograd_grad = PYTORCH_AUTOGRAD_GRAD
            self.active = None

    def register_compiled(self, module: ModuleType) -> None:
        self.compiled = module

    def compiled_dropped(self) -> None:
        self.compiled = None

    def first_order(self, outputs: Sequence[torch.Tensor]) -> bool:
        """Whether nothing can differentiate grad's backward of ``outputs`` again (the module's NOTE): the levels
        (grad innermost, only vmap below) and the graph, both checked in C++ (``kernels/first_order.cpp``)."""
        active, compiled = self.active, self.compiled
        return (self.enabled and compiled is not None and active is not None and active()
                and compiled.backward_is_first_order(list(outputs)))

    def autograd_grad(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                      grad_outputs: Sequence[torch.Tensor] | None = None, retain_graph: bool = False,
                      create_graph: bool = True) -> tuple[torch.Tensor, ...]:
        """functorch's ``_autograd_grad``; grad's call (no cotangents) without ``create_graph`` where
        ``first_order``, in one engine call where it can be (NOTE [first-order engine call])."""
        if create_graph and grad_outputs is None and self.first_order(outputs):
            if self.engine_call and not retain_graph:
                compiled = self.compiled
                below_grad = compiled.first_order_gradients if self.below_grad and compiled is not None else None
                grads = first_order_backward(outputs, inputs, below_grad)
                if grads is not None:
                    return grads
            create_graph = False
        return PYTORCH_AUTOGRAD_GRAD(outputs, inputs, grad_outputs, retain_graph, create_graph)


PATCH = FirstOrderGrad()
