import pytest

import registry


@pytest.fixture(autouse=True)
def _no_leftover_routing():
    """Every test starts and ends outside use(), with PyTorch's own entry points in place."""
    registry.load()
    assert not registry.routing_active()
    yield
    assert not registry.routing_active(), "a test left a use() frame open"
