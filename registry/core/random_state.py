"""The random state a run may be started again from: saved before a transform runs where a retry may follow
(``out_arguments``' retry, vmap's in ``functionalization``, a pre-2.0 Function's loop in ``legacy_functions``), put
back before the run again, so that it draws the numbers the first run drew.

Saving is on the path of every such transform call inside ``use()``, retry or not, so it is made cheap: with the
compiled kernels loaded, the CPU generator's engine is copied in C++ (``kernels/random_state.cpp``: about 1,600
instructions a call under callgrind, against 9,600 for ``torch.get_rng_state()``, which builds a 5 KB byte tensor
each time); without them, ``torch.get_rng_state()``. CUDA's generators are saved only where this torch has CUDA
and it is initialized.
"""

from __future__ import annotations

from typing import Any

import torch

from registry.core import kernels

CUDA_BUILT = torch.version.cuda is not None or torch.version.hip is not None  # a CPU build never initializes CUDA


# The state save() took: the CPU generator's (a capsule of the compiled kernels, or PyTorch's byte tensor) and, where
# CUDA is initialized, each device's. A plain tuple: building a NamedTuple costs more than the C++ save itself.
Saved = tuple[Any, list[torch.Tensor] | None]


def save() -> Saved:
    """The default generators' state now."""
    compiled = kernels.loaded()
    cpu = compiled.save_cpu_random_state() if compiled is not None else torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if CUDA_BUILT and torch.cuda.is_initialized() else None
    return cpu, cuda


def restore(saved: Saved) -> None:
    """The default generators as ``save()`` found them."""
    cpu, cuda = saved
    if isinstance(cpu, torch.Tensor):
        torch.set_rng_state(cpu)
    else:  # a capsule: only the compiled kernels make one, so they are loaded
        compiled = kernels.loaded()
        if compiled is None:
            raise RuntimeError("random_state.restore: a state saved by the compiled kernels, which are not loaded")
        compiled.restore_cpu_random_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
