"""Apps under test run their lifespan (``with TestClient(app)``): the store, its watcher and the job worker start
and stop with each. The selector's evidence is process-wide: put back to the default store after every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from registry.store import evidence
from service.main import create_app
from service.settings import Settings


@pytest.fixture(autouse=True)
def _default_evidence() -> Iterator[None]:
    yield
    evidence.use_loader(None)
    evidence.use_profile_loader(None)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def serve(db_url: str) -> Iterator[Callable[..., TestClient]]:
    """``serve(**settings)``: a started app on this test's own store (``db`` may be overridden)."""
    clients: list[TestClient] = []

    def start(**settings: object) -> TestClient:
        settings = {"db": db_url, "evidence_poll_s": 0.05, **settings}
        client = TestClient(create_app(Settings(**settings)))
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in reversed(clients):
        client.__exit__(None, None, None)
