"""What the routing puts into PyTorch outside the dispatcher: one ``Patch`` object per module, installed in order.

Each patch owns what it changed and what it needs to change it back (the predicate it was given, its Library, the
originals), as ``install(active)`` and ``uninstall()``; ``active()`` says whether this thread is inside ``use()`` with
a policy that routes. Elsewhere each patched entry point runs PyTorch's own code. The router installs them in the
order below and uninstalls them in reverse (``inplace_under_jvp`` wraps what ``out_arguments`` wrapped, which wraps
``transform_calls``' grad).

- ``transform_calls``: functorch's ``vmap_impl`` and ``grad_and_value_impl`` with less Python per call (and the
  level runner ``functionalization`` calls); first, so that ``out_arguments``' retry wraps its grad.
- ``functional_calls``: ``torch.func.functional_call`` with one walk of the module tree per call.
- ``out_arguments``: the ``out=`` kernels, registered with the C++ routing kernels; with the Python ones grad's,
  vjp's and jvp's implementations retry an ``out=`` refusal with them.
- ``inplace_under_jvp``: jvp's implementation registers the kernels of the overloads routed only under jvp.
- ``fresh_buffers``: the kernels of an automatically functionalized region (registered at the first one).
- ``mask_indexing``: boolean-mask reads and writes under vmap (registered at the first refusal).
- ``functionalization``: functorch's ``_flat_vmap``, which functionalizes a level where a write needs it.
- ``legacy_functions``: ``torch.autograd.Function.apply`` for pre-2.0 Functions under a transform.
- ``checkpointing``: ``torch.utils.checkpoint`` in both forms (the reentrant one is a pre-2.0 Function).
- ``flex_attention``: a vmap rule for the ``flex_attention`` higher-order operator.
- ``batch_rules``: C++ batching rules over functorch's slower ones (the NLL loss, group norm, convolution's
  per-sample weight gradient; C++ backend only).
- ``first_order_grad``: grad's backward without ``create_graph`` where nothing can differentiate it again (C++
  backend only).

PyTorch's attributes and dispatcher are one per process, so the patches are too: ``PATCHES`` holds each module's
``PATCH``, and every router installs those (one registry's routing is installed at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Protocol, runtime_checkable

from registry.core import (
    batch_rules,
    checkpointing,
    first_order_grad,
    flex_attention,
    fresh_buffers,
    functional_calls,
    functionalization,
    inplace_under_jvp,
    legacy_functions,
    mask_indexing,
    out_arguments,
    transform_calls,
)


class Patch(Protocol):
    """One module's change to PyTorch, and its undoing."""

    def install(self, active: Callable[[], bool]) -> None:
        """Put the change in place; ``active()``: whether this thread routes."""
        ...

    def uninstall(self) -> None:
        """Take everything ``install`` (and what it registered since) put in place out again."""
        ...


@runtime_checkable
class CompiledKernels(Protocol):
    """A patch whose kernels the C++ backend registers with its routing kernels, into their Library (so they go
    with them, on a switch to the Python backend or at uninstall): ``out_arguments``, ``batch_rules``,
    ``fresh_buffers`` (at its first region, behind a C++ gate); or that calls the compiled module while it is loaded
    (``first_order_grad``)."""

    def register_compiled(self, module: ModuleType) -> None:
        """Register this patch's kernels through the compiled routing's ``module`` (after its routing kernels)."""
        ...

    def compiled_dropped(self) -> None:
        """The compiled routing's Library, and this patch's kernels in it, are gone."""
        ...


PATCHES: tuple[Patch, ...] = (transform_calls.PATCH, functional_calls.PATCH, out_arguments.PATCH,
                              inplace_under_jvp.PATCH, fresh_buffers.PATCH, mask_indexing.PATCH,
                              functionalization.PATCH, legacy_functions.PATCH, checkpointing.PATCH,
                              flex_attention.PATCH, batch_rules.PATCH, first_order_grad.PATCH)
