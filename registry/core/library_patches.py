"""PyTorch entry points that no dispatcher kernel can reach, patched process-wide and active only inside ``use()``.

Each patch is one module with its own ``install(active)`` and ``uninstall()``; ``active()`` says whether this thread
is inside ``use()`` with a policy that routes. Elsewhere each patched entry point runs PyTorch's own code.

- ``legacy_functions``: ``torch.autograd.Function.apply`` for pre-2.0 Functions (no ``setup_context``) under a
  transform.
"""

from __future__ import annotations

from collections.abc import Callable

from registry.core import legacy_functions


def install(active: Callable[[], bool]) -> None:
    legacy_functions.install(active)


def uninstall() -> None:
    legacy_functions.uninstall()
