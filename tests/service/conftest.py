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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module that sets ``STORE_BACKENDS = ("sqlite", "postgres")`` runs each of its tests that use a store
    (``db_url``, ``serve``) once per backend: the service must behave the same on both."""
    backends = getattr(metafunc.module, "STORE_BACKENDS", None)
    if backends and "db_url" in metafunc.fixturenames:
        metafunc.parametrize("db_url", backends, indirect=True)


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """This test's own store: a SQLite file in tmp_path, or a new PostgreSQL database (see pytest_generate_tests)."""
    if getattr(request, "param", "sqlite") == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def serve(db_url: str) -> Iterator[Callable[..., TestClient]]:
    """``serve(**settings)``: a started app on this test's own store (``db`` may be overridden)."""
    clients: list[TestClient] = []

    def start(**settings: object) -> TestClient:
        # Jobs in process on both backends: these tests exercise the service's own runner (on PostgreSQL the
        # default sends jobs to `multicomposite worker` processes; tests/service/test_workers.py starts those).
        settings = {"db": db_url, "evidence_poll_s": 0.05, "jobs": "in-process", **settings}
        client = TestClient(create_app(Settings(**settings)))
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in reversed(clients):
        client.__exit__(None, None, None)
