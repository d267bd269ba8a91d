"""collection_paused: the collector is off inside the block and back to what it was after, even on an error."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from registry.core.collector import collection_paused


@pytest.fixture
def collector_state() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_pauses_and_reenables(collector_state: None) -> None:
    gc.enable()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_leaves_a_disabled_collector_disabled(collector_state: None) -> None:
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_reenables_after_an_error(collector_state: None) -> None:
    gc.enable()
    with pytest.raises(ValueError, match="inside"), collection_paused():
        raise ValueError("inside")
    assert gc.isenabled()


def test_the_block_starts_no_collection_of_the_older_generations(collector_state: None) -> None:
    # The middle generation is due (threshold 0, one young collection counted): an automatic collection after the
    # block would take it; the block's own young collection at its end leaves it for later allocations.
    thresholds = gc.get_threshold()
    started: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.enable()
    gc.collect()
    gc.set_threshold(thresholds[0], 0, 1_000_000)
    gc.collect(0)
    kept = []
    gc.callbacks.append(record)
    try:
        with collection_paused():
            kept.extend([i] for i in range(20 * thresholds[0]))
        assert started == [0]
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)
