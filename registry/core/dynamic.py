"""Dynamic-shape ops under vmap: refused inside ``use()`` with an error that says why and names the alternative.

``nonzero``, ``unique`` or ``masked_select`` over a batched mask return a shape that depends on the values, so no
batching rule can exist: each sample would need a different shape. PyTorch says "We do not support batching operators
that can output dynamic shape" (or, for ``argwhere``, loops and fails when the shapes differ); inside ``use()`` the
error also names the fixed-shape form to write instead. This is not coverage: the op still fails, with a better
error. Outside vmap, and for arguments vmap does not batch, PyTorch's own kernel runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from registry.core.context import functorch_stack, vmap_levels
from registry.core.frames import calling_user_frame
from registry.core.ops import aten_schema

DISPATCH_KEY = "FuncTorchDynamicLayerFrontMode"


@dataclass(frozen=True)
class DynamicShape:
    overload: str  # "nonzero" or "masked_select" (the packet, then ".overload" if any)
    batched: tuple[str, ...]  # the arguments whose batching makes the shape dynamic (schema names)
    alternative: str  # what to write instead, in a sentence
    name: str  # what the user called: "unique" for aten::_unique2


DYNAMIC_SHAPE: dict[str, DynamicShape] = {}


def declare_dynamic_shape(overload: str, batched: tuple[str, ...], alternative: str, name: str = "") -> None:
    """Refuse ``aten::overload`` under vmap inside ``use()`` when one of ``batched`` is batched, naming
    ``alternative``."""
    DYNAMIC_SHAPE[overload] = DynamicShape(overload, batched, alternative, name or overload.partition(".")[0])


# The words every refusal carries: the survey recognizes them as "by design", as it does vmap's own refusal.
REFUSAL_PHRASE = "returns a shape that depends on the values of"


def message(spec: DynamicShape) -> str:
    values = " or ".join(spec.batched)
    return (f"vmap: {spec.name} {REFUSAL_PHRASE} {values}, so it cannot be batched "
            f"(each sample would need its own shape); {spec.alternative}")


def _positions(overload: str, names: tuple[str, ...]) -> dict[str, int]:
    schema = aten_schema(overload)
    return {arg.name: i for i, arg in enumerate(schema.arguments) if arg.name in names}


def make_kernel(spec: DynamicShape, native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    """The front-key kernel: refuses when ``routing_on()`` (inside ``use()``, not inside a composite) and one of the
    named arguments is batched at the innermost vmap level; PyTorch's own kernel otherwise."""
    call_native = native.call_boxed
    positions = _positions(spec.overload, spec.batched)
    text = message(spec)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if routing_on():
            vmaps = [level for transform, level in functorch_stack() if transform == "vmap"]
            if vmaps:
                innermost = max(vmaps)
                for name, position in positions.items():
                    value = args[position] if position < len(args) else kwargs.get(name)
                    if isinstance(value, torch.Tensor) and innermost in vmap_levels(value):
                        frame = calling_user_frame()
                        raise RuntimeError(text if frame is None else f"{text} (called at {frame.describe()})")
        return call_native(keyset, *args, **kwargs)

    kernel.__name__ = f"multicomposite_refuse_{spec.overload.replace('.', '_')}"
    return kernel


def register(library: torch.library.Library, routing_on: Callable[[], bool], done: set[str]) -> None:
    """Register the refusing kernel of every declared overload not in ``done`` (adds them to it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        for overload, spec in DYNAMIC_SHAPE.items():
            if overload in done:
                continue
            native = torch.library.get_kernel(f"aten::{overload}", DISPATCH_KEY)
            library.impl(overload, make_kernel(spec, native, routing_on), DISPATCH_KEY, with_keyset=True)
            done.add(overload)


_NONZERO_STATIC = ("use torch.nonzero_static(input, size=N, fill_value=-1), which pads every sample's indices to N "
                   "rows")
declare_dynamic_shape("nonzero", ("self",), _NONZERO_STATIC)
declare_dynamic_shape("argwhere", ("self",), _NONZERO_STATIC)
declare_dynamic_shape("masked_select", ("mask",),
                      "use torch.where(mask, self, fill) or self.masked_fill(~mask, fill), which keep self's shape, "
                      "or torch.nonzero_static on the mask to gather a fixed number of elements")
for _unique in ("_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"):
    declare_dynamic_shape(_unique, ("self",),
                          "sort the values (torch.sort keeps the shape) and mark first occurrences with a mask "
                          "(sorted[..., 1:] != sorted[..., :-1]), or pad to a fixed count with torch.nonzero_static",
                          name=_unique.lstrip("_").removesuffix("2"))
