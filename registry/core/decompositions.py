"""``decomposition_table()``: the selected composites as a decomposition table for graph capture.

``make_fx(..., decomposition_table=...)``, ``aot_autograd(decompositions=...)`` and
``ExportedProgram.run_decompositions(...)`` apply a table below functorch, to a flat graph: the decision is made
once, for the stack the caller names, rather than per call as ``use()`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from registry.core.kinds import KIND, NATIVE
from registry.core.ops import OPS
from registry.core.registration import COMPOSITES, DERIVATIVES, load
from registry.core.runners import runner
from registry.core.selector import Decision, SelectionError, select, unknown_op_message


def _traceable(decision: Decision) -> tuple[Callable[..., Any], str]:
    """The decision's composite and kind, or, where its kind cannot stand in a table (``Kind.traceable``: a
    primitive), the first valid composite of a kind that can in its order: a table applies to a flat graph below
    every transform, where a primitive's vmap and jvp rules have nothing to apply to, and its fused bodies (C kernels
    on the values) run while the graph is traced, so their results would be baked into it as constants."""
    if KIND[decision.kind].traceable:
        return decision.fn, decision.kind
    for verdict in decision.alternatives:
        if verdict.ok and KIND[verdict.kind].traceable:
            return COMPOSITES[decision.op][verdict.composite].fn, verdict.kind
    return COMPOSITES[decision.op][NATIVE.name].fn, NATIVE.name


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
        native_runs = KIND[kind].runs_native
        if native_runs[False]:  # PyTorch's own op: left out, in place too
            continue
        for overload in OPS[name].overloads:
            if not native_runs[overload.inplace]:  # a mutating choice keeps PyTorch's in-place kernel
                table[overload.op_overload] = runner(fn, overload)
        # Autograd records the native op's derivative before a table applies (aot_autograd decomposes below
        # autograd): its derivative ops go with it.
        for derivative, functional in DERIVATIVES[name].items():
            packet, _, overload_name = derivative.partition(".")
            table[getattr(getattr(torch.ops.aten, packet), overload_name or "default")] = functional
    return table
