"""The C++ ops of this package (``torch.ops.multicomposite``: the fused primitives, linear, group norm, the rows
ops), looked up once the extension that registers them is loaded. The cpp_op composites of every family call them
through ``OPS``."""

from __future__ import annotations

from typing import Any

import torch


class CppOps:
    """The C++ ops' overloads, looked up once they are registered (the extension loaded: the kind's rule loads it
    before any decision picks a cpp_op composite; a direct call loads it here)."""

    def __init__(self) -> None:
        self._ops: Any = None

    def get(self) -> Any:
        ops = self._ops
        if ops is None:
            from registry.core import kernels

            if not kernels.fused_ops_available():
                raise RuntimeError("multicomposite's C++ ops are not built in this process; build them with "
                                   f"`multicomposite build-kernels` ({kernels.HOW_TO})")
            ops = self._ops = torch.ops.multicomposite
        return ops


OPS = CppOps()
