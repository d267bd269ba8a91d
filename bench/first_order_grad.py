"""``python -m bench.first_order_grad [--batch 4 16 64] [--only NAME ...] [--rounds 7]``: what grad's backward without
``create_graph`` (``registry/core/first_order_grad.py``) changes in whole per-sample-gradient steps.

Every ``bench.models`` workload runs inside ``use()`` two ways in one process, in alternating rounds (the order
alternating too): as ``use()`` runs it (``first-order``) and with the patch switched off for that way's timing
(``create-graph``: grad's backward with ``create_graph``, as PyTorch runs it). One intra-op thread, the calling
thread's CPU time; a way's time is its best round (each round the median call). Both ways' per-sample gradients are
checked against the per-sample loop.
"""

from __future__ import annotations

import contextlib

from bench.batch_rules import compare, switched_off
from registry.core import first_order_grad


def create_graph() -> contextlib.AbstractContextManager[None]:
    """grad keeps ``create_graph`` inside ``use()`` while the block runs."""
    return switched_off(lambda on: setattr(first_order_grad.PATCH, "enabled", on))


def main(argv: list[str] | None = None) -> None:
    compare("python -m bench.first_order_grad", __doc__ or "", argv, ("create-graph", "first-order"), create_graph)


if __name__ == "__main__":
    main()
