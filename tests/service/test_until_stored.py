"""``running.until_stored``: a write the store refuses is tried again, with waits that double, until it is taken;
any other error, and a stop, end the tries as its docstring says."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from registry.store.connection import StoreUnavailableError
from service.jobs import running

log = logging.getLogger("test.until_stored")


class Refusing:
    """A write that the store refuses ``refusals`` times, then takes; ``on_refusal`` runs at each refusal."""

    def __init__(self, refusals: int, on_refusal: Any = None) -> None:
        self.refusals = refusals
        self.calls = 0
        self.on_refusal = on_refusal

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.refusals:
            if self.on_refusal is not None:
                self.on_refusal()
            raise StoreUnavailableError("the store at sqlite:///x.db failed during a write (database is locked)")
        return "stored"


@pytest.fixture(autouse=True)
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(running, "RETRY_FIRST_S", 0.001)
    monkeypatch.setattr(running, "RETRY_MAX_S", 0.004)


def test_a_refused_write_is_tried_again_with_doubling_waits_until_taken(caplog: pytest.LogCaptureFixture) -> None:
    write = Refusing(4)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert running.until_stored(write, "the job's end", "j1", threading.Event(), log) == "stored"
    assert write.calls == 5
    waits = [record.args[-1] for record in caplog.records]
    assert waits == [0.001, 0.002, 0.004, 0.004]  # doubling, up to RETRY_MAX_S
    assert all(record.args[:2] == ("j1", "the job's end") for record in caplog.records)
    assert "StoreUnavailableError: the store at sqlite:///x.db" in caplog.records[0].getMessage()


def test_an_error_that_is_not_the_stores_is_raised_at_once() -> None:
    calls = []

    def write() -> None:
        calls.append(1)
        raise TypeError("Object of type set is not JSON serializable")

    with pytest.raises(TypeError, match="not JSON serializable"):
        running.until_stored(write, "the job's end", "j1", threading.Event(), log)
    assert len(calls) == 1


def test_a_stop_during_the_wait_returns_none_without_another_try() -> None:
    stop = threading.Event()
    write = Refusing(10, on_refusal=stop.set)
    assert running.until_stored(write, "the job's start", "j1", stop, log) is None
    assert write.calls == 1


def test_with_raise_when_stopping_a_stop_raises_the_stores_error() -> None:
    stop = threading.Event()
    write = Refusing(10, on_refusal=stop.set)
    with pytest.raises(StoreUnavailableError, match="database is locked"):
        running.until_stored(write, "the job's claim", "j1", stop, log, raise_when_stopping=True)
    assert write.calls == 1


def test_with_raise_when_stopping_a_stop_during_the_wait_gets_one_last_try() -> None:
    """A worker stopping while it waits tries once more (the store may answer now), and raises if it is refused."""
    stop = threading.Event()
    write = Refusing(1)
    original_wait = stop.wait

    def wait_then_stop(seconds: float) -> bool:
        stop.set()
        return original_wait(seconds)

    stop.wait = wait_then_stop  # type: ignore[method-assign]
    assert running.until_stored(write, "the job's end", "j1", stop, log, raise_when_stopping=True) == "stored"
    assert write.calls == 2
