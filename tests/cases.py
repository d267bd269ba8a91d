"""How many cases the sampled tests run: ``make test`` a fixed subset sized for CI, ``make test-all``
(``MULTICOMPOSITE_TEST_ALL=1``) every case, which the conformance and survey figures in the docs are measured with."""

from __future__ import annotations

import os
from collections.abc import Sequence

ALL_CASES = os.environ.get("MULTICOMPOSITE_TEST_ALL") == "1"


def samples(subset: int) -> int:
    """The number of samples an entry is checked on: ``subset``, or 0 (every sample) under ``make test-all``."""
    return 0 if ALL_CASES else subset


def matrix_stacks(stacks: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The generated stacks a matrix test runs: under ``make test`` ``compile`` around vmap alone of the compiled
    stacks (each costs about 1.5-3 s per op, against 0.1 s for the others; compile around grad, jvp and two
    transforms are 11 of the matrix's 12 compiled stacks, and tests/composites/test_stacks.py compiles vmap inside
    ``use()`` for every seed op); every stack under ``make test-all``."""
    if ALL_CASES:
        return list(stacks)
    return [stack for stack in stacks if stack[0] != "compile" or stack == ("compile", "vmap")]
