"""Fixtures shared by the composites' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from registry.core import routing


@pytest.fixture
def cpp_routing() -> Iterator[None]:
    """The C++ routing backend (the only one with the redirect and the first-order backward), then the one before."""
    before = routing.routing_backend()
    routing.set_routing_backend("cpp")
    yield
    routing.set_routing_backend(before)
