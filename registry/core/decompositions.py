"""``decomposition_table()``: the selected composites as a decomposition table for graph capture.

``make_fx(..., decomposition_table=...)``, ``aot_autograd(decompositions=...)`` and
``ExportedProgram.run_decompositions(...)`` apply a table below functorch, to a flat graph: the decision is made
once, for the stack the caller names, rather than per call as ``use()`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from registry.core.model import Overload
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES, DERIVATIVES, load
from registry.core.selector import Decision, SelectionError, select, unknown_op_message


def _functional(fn: Callable[..., Any], overload: Overload) -> Callable[..., Any]:
    adapt = overload.adapt

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        cargs, ckwargs = (args, kwargs) if adapt is None else adapt(args, kwargs)
        return fn(*cargs, **ckwargs)

    decomposition.__name__ = f"{fn.__name__}_for_{overload.name.replace('.', '_')}"
    return decomposition


def _inplace(fn: Callable[..., Any], overload: Overload) -> Callable[..., Any]:
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        return args[0].copy_(fn(*args, **kwargs))

    decomposition.__name__ = f"{fn.__name__}_for_{overload.name.replace('.', '_')}"
    return decomposition


def _traceable(decision: Decision) -> tuple[Callable[..., Any], str]:
    """The decision's composite and kind, or, where it chose a primitive, the first valid composite of another kind
    in its order: a table applies to a flat graph below every transform, where a primitive's vmap and jvp rules have
    nothing to apply to, and its fused bodies (C kernels on the values) run while the graph is traced, so their
    results would be baked into it as constants."""
    if decision.kind != "primitive":
        return decision.fn, decision.kind
    for verdict in decision.alternatives:
        if verdict.ok and verdict.kind != "primitive":
            return COMPOSITES[decision.op][verdict.composite].fn, verdict.kind
    return COMPOSITES[decision.op]["native"].fn, "native"


def decomposition_table(
    stack: str | Iterable[str] = (),
    policy: str = "auto",
    ops: Iterable[str] | None = None,
    *,
    pins: Mapping[str, str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> dict[Any, Callable[..., Any]]:
    """``{OpOverload: composite}`` for every overload of ``ops`` (default: every covered op) whose selected composite
    under ``stack`` is not PyTorch's own; an op whose choice is native is left out, so PyTorch's kernel stays.

    In-place overloads map to the composite followed by ``copy_`` into ``self``, except where the choice is
    ``mutating`` (PyTorch's in-place kernel is that already). A decomposed op brings the functional forms of its
    derivative ops (``masked_scatter_backward``).
    """
    load()
    names = list(OPS) if ops is None else list(ops)
    for name in names:
        if name not in OPS:
            raise SelectionError(f"decomposition_table(ops=...): {unknown_op_message(name)}")
    table: dict[Any, Callable[..., Any]] = {}
    for name in names:
        decision = select(name, stack=stack, policy=policy, pins=pins, dtype=dtype)
        fn, kind = _traceable(decision)
        if kind == "native":
            continue
        for overload in OPS[name].overloads:
            if not overload.inplace:
                table[overload.op_overload] = _functional(fn, overload)
            elif kind != "mutating":
                table[overload.op_overload] = _inplace(_functional(fn, overload), overload)
        # Autograd records the native op's derivative before a table applies (aot_autograd decomposes below
        # autograd): its derivative ops go with it.
        for derivative, functional in DERIVATIVES[name].items():
            packet, _, overload_name = derivative.partition(".")
            table[getattr(getattr(torch.ops.aten, packet), overload_name or "default")] = functional
    return table
