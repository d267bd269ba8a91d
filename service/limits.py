"""The bounds every interface applies to what a caller may ask for: the API's settings default to them, and the
command line applies the same ones, so one value is refused alike by ``POST /profiles`` and ``multicomposite
profile``. No imports: the command line reads them before it loads anything heavy."""

from __future__ import annotations

MAX_BATCH = 1024  # samples per batch a profiling job may time
MAX_NUMEL = 2**24  # elements per tensor (batch x numel) a profiling job may allocate
MAX_CONTEXTS = 256  # (op, stack, batch, dtype) contexts per job
PORTS = (1, 65535)  # the TCP ports a server may listen on
