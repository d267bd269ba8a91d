"""``python -m bench.below_levels [--batch 4 16 64] [--only NAME ...] [--rounds 7]``: what running the C++ batching
rules' kernels under the last level (``registry/core/kernels/batch_rules.cpp``: NOTE [kernels under the last
level]) changes in whole per-sample-gradient steps.

Every ``bench.models`` workload runs inside ``use()`` two ways in one process, in alternating rounds (the order
alternating too): as ``use()`` runs it (``once``: a rule restores the call's keys and pops the last level once around
its kernels), and switched off for that way's timing (``per-op``: every op a rule calls goes through functorch's
back fallback, as before). One intra-op thread, the calling thread's CPU time; a way's time is its best round (each
round the median call). Both ways' per-sample gradients are checked against the per-sample loop. C++ backend only.
"""

from __future__ import annotations

import contextlib

from bench.batch_rules import compare, switched_off
from registry.core import kernels


def per_op() -> contextlib.AbstractContextManager[None]:
    """Every op a rule calls through functorch's back fallback while the block runs."""
    return switched_off(kernels.load().set_below_levels_enabled)


def main(argv: list[str] | None = None) -> None:
    compare("python -m bench.below_levels", __doc__ or "", argv, ("per-op", "once"), per_op)


if __name__ == "__main__":
    main()
