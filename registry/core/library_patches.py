"""PyTorch entry points that no dispatcher kernel can reach, patched process-wide and active only inside ``use()``.

Each patch is one module with its own ``install(active)`` and ``uninstall()``; ``active()`` says whether this thread
is inside ``use()`` with a policy that routes. Elsewhere each patched entry point runs PyTorch's own code.

- ``legacy_functions``: ``torch.autograd.Function.apply`` for pre-2.0 Functions (no ``setup_context``) under a
  transform.
- ``checkpointing``: ``torch.utils.checkpoint`` in both forms (the reentrant one is a pre-2.0 Function).
- ``flex_attention``: a vmap rule for the ``flex_attention`` higher-order operator.
"""

from __future__ import annotations

from collections.abc import Callable

from registry.core import checkpointing, flex_attention, legacy_functions


def install(active: Callable[[], bool]) -> None:
    legacy_functions.install(active)
    checkpointing.install(active)
    flex_attention.install(active)


def uninstall() -> None:
    flex_attention.uninstall()
    checkpointing.uninstall()
    legacy_functions.uninstall()
