"""Evidence reaches the selector through the registered source: the store's by default, any other when registered."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

import registry
from registry.core import evidence
from registry.core.context import Context
from registry.core.evidence import Evidence, NoEvidence, Timing
from registry.store import evidence as store_evidence


class _FailingNative:
    """A source that says native mismatched (eager, float32), and timed nothing."""

    def evidence(self, op: str, composite: str, ctx: Context,
                 tensor_args: tuple[str, ...]) -> tuple[Evidence | None, int]:
        if composite == "native":
            return Evidence("mismatch", "native: mismatch 2 under no transform, pattern -, float32"), 1
        return None, 0

    def timings(self, op: str, ctx: Context, candidates: Iterable[str]) -> dict[str, Timing]:
        return {}


@pytest.fixture
def restored_source() -> Iterator[None]:
    yield
    evidence.register_source(store_evidence.SOURCE)


def test_the_store_is_the_registered_source() -> None:
    assert evidence.source() is store_evidence.SOURCE


def test_a_registered_source_decides_and_drops_cached_decisions(restored_source: None) -> None:
    evidence.register_source(NoEvidence())
    assert registry.select("index_fill", dtype="float32").composite == "native"  # cached now
    evidence.register_source(_FailingNative())
    after = registry.select("index_fill", dtype="float32")
    assert after.composite != "native"
    native = next(v for v in after.alternatives if v.kind == "native")
    assert not native.ok
    assert native.reason == "mismatch: measured: native: mismatch 2 under no transform, pattern -, float32"


def test_without_a_source_the_rules_decide(restored_source: None) -> None:
    evidence.register_source(NoEvidence())
    decision = registry.select("index_fill", dtype="float32")
    assert decision.composite == "native"
    assert decision.reason.endswith("(unverified: no measurement yet, rules decide).")
