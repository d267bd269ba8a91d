"""The words that ``select``, ``matrix`` and ``jobs`` offer as choices, held here so that ``COMMAND --help`` answers
without importing torch: every module of the registry runs ``registry/__init__``, which imports torch and registers
the built-in composites (about 1.5 s). The registry's own tuples stay the definitions;
tests/service/test_cli_vocabulary.py checks that each copy here equals its source.
"""

from __future__ import annotations

# registry.core.selector.POLICIES
POLICIES: tuple[str, ...] = ("auto", "fastest", "rules", "native")
# registry.core.status.STATUSES
STATUSES: tuple[str, ...] = ("ok", "slow", "error", "mismatch", "unsupported")
# registry.store.job_store.JOB_STATES
JOB_STATES: tuple[str, ...] = ("queued", "running", "cancelling", "done", "failed", "cancelled", "interrupted")
