"""Fixtures shared by the composites' tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from registry.core import routing


@pytest.fixture
def cpp_routing() -> Iterator[None]:
    """The C++ routing backend (the only one with the redirect and the first-order backward), then the one before."""
    before = routing.routing_backend()
    routing.set_routing_backend("cpp")
    yield
    routing.set_routing_backend(before)


@pytest.fixture
def python_calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``count(holder)``: from then on, every ``holder.get()`` (a composite module's handle on its C++ ops, which
    only the composite's Python function calls) is appended to the returned list."""

    def count(holder: Any) -> list[int]:
        calls: list[int] = []
        real = holder.get

        def counted() -> Any:
            calls.append(1)
            return real()

        monkeypatch.setattr(holder, "get", counted)
        return calls

    return count
