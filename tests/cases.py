"""How many cases the sampled tests run: ``make test`` a fixed subset sized for CI, ``make test-all``
(``MULTICOMPOSITE_TEST_ALL=1``) every case, which the conformance and survey figures in the docs are measured with."""

from __future__ import annotations

import os

ALL_CASES = os.environ.get("MULTICOMPOSITE_TEST_ALL") == "1"


def samples(subset: int) -> int:
    """The number of samples an entry is checked on: ``subset``, or 0 (every sample) under ``make test-all``."""
    return 0 if ALL_CASES else subset
