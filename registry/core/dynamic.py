"""Dynamic-shape ops under vmap inside ``use()``: computed per sample where the samples' shapes agree, else split.

``nonzero``, ``unique`` or ``masked_select`` over a batched mask return a shape that depends on the values, so no
batching rule can exist for every batch: each sample may need a different shape. PyTorch refuses them all ("We do not
support batching operators that can output dynamic shape"). Inside ``use()`` the op runs on each sample's values where
every sample's output has the same shape (their outputs are integers or a selection, so nothing is lost: masked_select
selects with a differentiable index_select); where the shapes differ, ``SamplesDisagreeError`` names the user's line and
the fixed-shape form, and the level's vmap re-runs the function on the groups of samples whose shapes agree
(registry.core.batch_split). Outside vmap, and for arguments vmap does not batch, PyTorch's own kernel runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch._C import _DisableFuncTorch  # noqa: PLC2701 - functorch's bindings have no public API

from registry.core.context import DISPATCH_KEY, functorch_stack, vmap_levels
from registry.core.disagree import LevelValues, SamplesDisagreeError, level_values, wrap
from registry.core.frames import calling_user_frame
from registry.core.ops import aten_schema


@dataclass(frozen=True)
class DynamicShape:
    overload: str  # "nonzero" or "masked_select" (the packet, then ".overload" if any)
    batched: tuple[str, ...]  # the arguments whose batching makes the shape dynamic (schema names)
    alternative: str  # what to write instead, in a sentence
    name: str  # what the user called: "unique" for aten::_unique2


def refused(overload: str, batched: tuple[str, ...], alternative: str, name: str = "") -> DynamicShape:
    """Refuse ``aten::overload`` under vmap inside ``use()`` when one of ``batched`` is batched, naming
    ``alternative``."""
    return DynamicShape(overload, batched, alternative, name or overload.partition(".")[0])


# The words every refusal carries: the survey recognizes them as "by design", as it does vmap's own refusal.
REFUSAL_PHRASE = "returns a shape that depends on the values of"


def message(spec: DynamicShape) -> str:
    values = " or ".join(spec.batched)
    return (f"vmap: {spec.name} {REFUSAL_PHRASE} {values}, so it cannot be batched "
            f"(each sample would need its own shape); {spec.alternative}")


def _positions(overload: str, names: tuple[str, ...]) -> dict[str, int]:
    schema = aten_schema(overload)
    return {arg.name: i for i, arg in enumerate(schema.arguments) if arg.name in names}


def per_sample(spec: DynamicShape, found: LevelValues, compute: Callable[[torch.Tensor], Any],
               site: str, text: str = "") -> Any:
    """``compute`` (a dynamic-shape op returning a tensor or a tuple of them, nothing differentiable) run on every
    sample of ``found``, the results batched at its levels where every sample's shapes agree; where they differ,
    ``SamplesDisagreeError`` keyed by each sample's shapes, so that the level splits into groups whose shapes agree (its
    message ``text``, else the op's refusal with the user's line ``site``)."""
    with _DisableFuncTorch():
        flat = found.flat()
        results = [compute(sample) for sample in flat]
        tuples = [r if isinstance(r, tuple) else (r,) for r in results]
        shapes = [tuple(tuple(t.shape) for t in r) for r in tuples]
        if len(set(shapes)) > 1:
            # One op's outputs have the same number of dimensions in every sample: their sizes are the key.
            keys = torch.tensor([sum(s, ()) for s in shapes]).reshape(*found.batch_shape, -1)
            text = text or message(spec) + (f" (called at {site})" if site else "")
            raise SamplesDisagreeError(text, found.levels, keys, site, spec.alternative)
        stacked = tuple(torch.stack(list(column)).reshape(*found.batch_shape, *column[0].shape)
                        for column in zip(*tuples, strict=True))
    wrapped = tuple(wrap(t, found.levels) for t in stacked)
    return wrapped if isinstance(results[0], tuple) else wrapped[0]


def _compute(spec: DynamicShape, args: tuple[Any, ...], kwargs: dict[str, Any], site: str) -> Any:
    """The op on a batched argument, per sample, where every sample's output shape agrees (else the split's error);
    NotImplemented where it cannot be computed so (a wrapper that cannot be peeled)."""
    overload = torch.ops.aten
    packet, _, name = spec.overload.partition(".")
    op = getattr(getattr(overload, packet), name or "default")
    if packet == "masked_select":
        self, mask = args[0], args[1]
        self_b, mask_b = torch.broadcast_tensors(self, mask)
        found = level_values(mask_b.reshape(-1))
        if found is None:
            return NotImplemented
        flat_index = per_sample(spec, found, lambda m: torch.nonzero(m).reshape(-1), site)
        # Differentiable in self: an index_select of its flattened samples at their (agreeing) positions.
        return self_b.reshape(-1).index_select(0, flat_index)
    found = level_values(args[0])
    if found is None:
        return NotImplemented
    rest = args[1:]
    return per_sample(spec, found, lambda sample: op(sample, *rest, **kwargs), site)


def make_kernel(spec: DynamicShape, native: Any, routing_on: Callable[[], bool]) -> Callable[..., Any]:
    """The front-key kernel: when ``routing_on()`` (inside ``use()``, not inside a composite) and one of the named
    arguments is batched at the innermost vmap level, the op per sample where the samples' shapes agree, else
    ``SamplesDisagreeError`` (the level's vmap splits the batch, registry.core.batch_split); PyTorch's own kernel
    otherwise."""
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
                        site = frame.describe() if frame is not None else ""
                        result = _compute(spec, args, kwargs, site)
                        if result is NotImplemented:
                            raise RuntimeError(text if frame is None else f"{text} (called at {site})")
                        return result
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
_UNIQUE_ALTERNATIVE = ("sort the values (torch.sort keeps the shape) and mark first occurrences with a mask "
                       "(sorted[..., 1:] != sorted[..., :-1]), or pad to a fixed count with torch.nonzero_static")
# The overloads refused under vmap, by name: a constant table (what PyTorch's ops are), read-only.
DYNAMIC_SHAPE: Mapping[str, DynamicShape] = MappingProxyType({spec.overload: spec for spec in (
    refused("nonzero", ("self",), _NONZERO_STATIC),
    refused("argwhere", ("self",), _NONZERO_STATIC),
    refused("masked_select", ("mask",), "use torch.where(mask, self, fill) or self.masked_fill(~mask, fill), which "
            "keep self's shape, or torch.nonzero_static on the mask to gather a fixed number of elements"),
    *(refused(unique, ("self",), _UNIQUE_ALTERNATIVE, name=unique.lstrip("_").removesuffix("2"))
      for unique in ("_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive")),
)})
