"""``python -m bench.below_grad [--batch 4 16 64] [--only NAME ...] [--rounds 7]``: what running grad's first-order
backward with grad's level set aside (``registry/core/kernels/first_order.cpp``'s NOTE [first-order backward below the
grad level]) changes in whole per-sample-gradient steps.

Every ``bench.models`` workload runs inside ``use()`` two ways in one process, in alternating rounds (the order
alternating too): as ``use()`` runs it (``below-grad``: each backward op passes the vmap levels alone) and with the
set-aside switched off for that way's timing (``grad-level``: the same one engine call with grad's level in place, as
before it). One intra-op thread, the calling thread's CPU time; a way's time is its best round (each round the median
call). Both ways' per-sample gradients are checked against the per-sample loop.
"""

from __future__ import annotations

import contextlib

from bench.batch_rules import compare, switched_off
from registry.core import first_order_grad


def grad_level() -> contextlib.AbstractContextManager[None]:
    """The first-order engine call keeps grad's level in place while the block runs."""
    return switched_off(lambda on: setattr(first_order_grad.PATCH, "below_grad", on))


def main(argv: list[str] | None = None) -> None:
    compare("python -m bench.below_grad", __doc__ or "", argv, ("grad-level", "below-grad"), grad_level)


if __name__ == "__main__":
    main()
