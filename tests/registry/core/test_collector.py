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
