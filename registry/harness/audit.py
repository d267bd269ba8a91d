"""Audit of declared kinds: a composite must be what its kind says.

A ``functional`` composite may dispatch no in-place and no ``out=`` op (recorded with a ``TorchDispatchMode`` while
it runs on every sample); a ``primitive`` must pass ``gradcheck``, ``gradgradcheck`` and the forward-AD and
batched-gradient checks in float64, which also run its ``vmap`` rule against the per-sample loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 - TorchDispatchMode has no public home

from registry.core.messages import first_line
from registry.core.registration import COMPOSITES, RegistrationError, load
from registry.harness.samples import SAMPLES, Sample


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def dispatched(fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """The ATen overloads ``fn(*args, **kwargs)`` dispatches, in order."""
    recorder = _Recorder()
    with recorder:
        fn(*args, **kwargs)
    return recorder.ops


def _mutates(overload: Any) -> bool:
    schema = overload._schema
    return schema.is_mutable or overload._overloadname.startswith("out") or schema.name.endswith("_")


def _call(fn: Any, sample: Sample, args: dict[str, Any]) -> Any:
    positional = [v for k, v in args.items() if k not in sample.kwargs]
    return fn(*positional, **{k: args[k] for k in sample.kwargs if k in args})


def audit(op: str, name: str) -> None:
    """Raise ``RegistrationError`` if composite ``name`` of ``op`` is not what its kind declares."""
    load()
    composite = COMPOSITES[op][name]
    if composite.kind == "functional":
        for sample in SAMPLES[op]:
            for overload in dispatched(_call, composite.fn, sample, sample.build(0)):
                if _mutates(overload):
                    raise RegistrationError(
                        f"{composite.where}: composite {op}/{name} is declared functional but dispatches "
                        f"{overload} (in-place or out=) on sample {sample.name}; declare it mutating or use the "
                        "out-of-place op"
                    )
    elif composite.kind == "primitive":
        for sample in SAMPLES[op]:
            if sample.dtype != torch.float64 or not sample.differentiable:
                continue
            args = sample.build(0)
            if "dtype" in args and args["dtype"] != torch.float64:
                continue  # finite differences need float64 outputs

            def f(*tensors: torch.Tensor, args: dict[str, Any] = args, sample: Sample = sample) -> Any:
                return _call(composite.fn, sample, {**args, **dict(zip(sample.differentiable, tensors, strict=True))})

            inputs = tuple(args[n].detach().clone().requires_grad_() for n in sample.differentiable)
            try:
                torch.autograd.gradcheck(f, inputs, check_forward_ad=True, check_batched_grad=True,
                                         check_batched_forward_grad=True)
                torch.autograd.gradgradcheck(f, inputs)
            except (RuntimeError, torch.autograd.gradcheck.GradcheckError) as error:
                first = first_line(error)
                raise RegistrationError(
                    f"{composite.where}: primitive {op}/{name} fails its derivative checks on sample "
                    f"{sample.name}: {first}"
                ) from None
