"""Whole per-sample-gradient steps over real models (``python -m bench.models``).

Each module of this package (``transformer.py``, ``recurrent.py``, ``message_passing.py``, ...) declares
``WORKLOADS: list[Workload]``; ``python -m bench.models`` finds every module here and runs each workload three ways in
one process, in alternating rounds: natively (torch.func alone), inside ``registry.use()``, and as a per-sample
``torch.autograd`` loop outside any transform. It checks that ``use()``'s result equals the loop's, counts vmap's
fallback warnings both ways, and reports the ratios.

Where a workload gives them, two more ways run in the same rounds: its **floor** (``batched``, one ordinary batched
training step, plus a fill of tensors of the per-sample gradients' sizes made once, so that no allocator's page
faults count: what no per-sample-gradient step can go below), and the DP library's **hooks** (``hooks``: opacus's
``GradSampleModule`` on the same model, where its hooks support the layers), whose per-sample gradients are checked
against the loop too.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setup:
    """One workload built at one batch size.

    ``step`` runs the transformed computation (for example ``vmap(grad(loss))`` through ``functional_call``) and
    returns its result, a pytree of tensors; ``loop`` computes the same result one sample at a time with
    ``torch.autograd`` outside any transform (the reference); both take no arguments and close over the model and data.
    """

    step: Callable[[], Any]
    loop: Callable[[], Any]
    rtol: float = 1e-4
    atol: float = 1e-5
    # One ordinary training step over the whole batch (forward, the batch's loss, backward): the floor's first part.
    batched: Callable[[], Any] | None = None
    # The per-sample gradients by opacus's hooks (GradSampleModule), a pytree like ``step``'s; None where the hooks do
    # not support the model's layers or opacus is not installed.
    hooks: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Workload:
    """A named per-sample workload: ``build(batch_size)`` makes its model, data and the two ways to run it."""

    name: str
    family: str
    build: Callable[[int], Setup]


def all_workloads() -> list[Workload]:
    """Every workload of every module in this package, in module order."""
    found: list[Workload] = []
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        found.extend(getattr(module, "WORKLOADS", ()))
    return found
