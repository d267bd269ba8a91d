import os
import tempfile

import pytest

# Tests never touch the user's store: every run gets an empty SQLite file of its own.
os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{tempfile.mkdtemp(prefix='multicomposite-tests-')}/store.db"

import registry


@pytest.fixture(autouse=True)
def _no_leftover_routing():
    """Every test starts and ends outside use(), with PyTorch's own entry points in place."""
    registry.load()
    assert not registry.routing_active()
    yield
    assert not registry.routing_active(), "a test left a use() frame open"
