"""``python -m bench.transform_calls [--batch 4 16 64] [--only NAME ...] [--rounds 7]``: what the lean Python around
the per-sample function changes in whole per-sample-gradient steps: the lean ``vmap`` and ``grad`` calls
(``registry/core/transform_calls.py``), ``functional_call`` (``registry/core/functional_calls.py``) and the first-order
backward's one engine call (``registry/core/first_order_grad.py``: NOTE [first-order engine call]).

Every ``bench.models`` workload runs inside ``use()`` two ways in one process, in alternating rounds (the order
alternating too): as ``use()`` runs it (``lean``) and with the three switched off for that way's timing
(``functorch``: functorch's own ``vmap_impl``, ``grad_and_value_impl`` and ``_flat_vmap``, PyTorch's
``_functional_call``, ``torch.autograd.grad`` around the engine). One intra-op thread,
the calling thread's CPU time; a way's time is its best round (each round the median call). Both ways' per-sample
gradients are checked against the per-sample loop.
"""

from __future__ import annotations

import contextlib

from bench.batch_rules import compare, switched_off
from registry.core import first_order_grad, functional_calls, transform_calls


def _switch(on: bool) -> None:
    transform_calls.PATCH.enabled = on
    functional_calls.PATCH.enabled = on
    first_order_grad.PATCH.engine_call = on


def functorchs() -> contextlib.AbstractContextManager[None]:
    """PyTorch's own implementations inside ``use()`` while the block runs."""
    return switched_off(_switch)


def main(argv: list[str] | None = None) -> None:
    compare("python -m bench.transform_calls", __doc__ or "", argv, ("functorch", "lean"), functorchs)


if __name__ == "__main__":
    main()
