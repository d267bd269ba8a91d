import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests never touch the user's store: every run gets an empty SQLite file of its own.
os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{tempfile.mkdtemp(prefix='multicomposite-tests-')}/store.db"

import registry
from registry.harness import fallback
from registry.store import health
from tests.pgserver import PostgresServer, PostgresUnavailableError, require_server

# The suite checks the built-in families: load them before collection, whose parametrizations read the op table
# (``import registry`` leaves them for the first call that needs them; tests/registry/test_lazy_import.py checks that
# each such call loads them in a fresh interpreter).
registry.load()


@pytest.fixture(autouse=True)
def _no_leftover_routing():
    """Every test starts and ends outside use(), with PyTorch's own entry points in place."""
    registry.load()
    assert not registry.routing_active()
    yield
    assert not registry.routing_active(), "a test left a use() frame open"


@pytest.fixture(autouse=True)
def _no_leftover_store_retry():
    """A retry of a store that failed to read in one test must not fire in the next, whose MULTICOMPOSITE_DB it would
    read (registry.store.health: a retry every 30 s while the store cannot be read)."""
    yield
    health.HEALTH.cancel()


@pytest.fixture
def fallback_warnings():
    """vmap's per-sample fallback warning, switched on and recorded (the tests that assert no fallback share it)."""
    with fallback.watch() as caught:
        yield caught


# PostgreSQL ------------------------------------------------------------------------------------------------------
# One throwaway cluster per test session (tests/pgserver.py), started on first use; each test that asks for
# ``postgres_url`` gets a new database on it, with the store's schema, dropped afterwards. Without the server
# binaries these tests skip, saying how to install them; under ``make test`` as root (POSTGRES_TEST_REQUIRE_SERVER=1,
# after the Makefile installed the package) they fail instead.


def _started_server() -> PostgresServer:
    """A started server, or the test skipped (binaries missing) / failed (missing under make test as root)."""
    server = None
    try:
        server = PostgresServer()
        server.start()
    except PostgresUnavailableError as error:
        if server is not None:
            server.stop()
        if require_server():
            pytest.fail(f"PostgreSQL tests cannot run: {error}", pytrace=False)
        pytest.skip(f"PostgreSQL tests skipped: {error}")
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = _started_server()
    yield server
    server.stop()


@pytest.fixture
def postgres_own_server() -> Iterator[PostgresServer]:
    """A server of this test's own (about 2 s to start), for a test that kills or stops it: ``kill()`` is kill -9
    of the postmaster, ``restart()`` starts it again (crash recovery), ``create_database()`` gives a URL."""
    server = _started_server()
    yield server
    server.stop()


@pytest.fixture
def postgres_empty_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A new database on the session's server with no tables at all, dropped after the test (for migrations and
    for the store's refusal to open an unmigrated server database)."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


@pytest.fixture
def postgres_url(postgres_empty_url: str) -> str:
    """A new database holding the store's schema at the newest revision (``multicomposite db upgrade`` ran):
    ``Store(postgres_url)`` opens it."""
    from registry.store.migrate import upgrade

    upgrade(postgres_empty_url)
    return postgres_empty_url


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store's URL, once on SQLite (a file in tmp_path) and once on PostgreSQL: for tests of the store's
    behaviour, which must be the same on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_url")


# make test's second part collects this folder alone (the whole suite's collection costs it about 11 s): a test
# marked serial anywhere else would run in neither part.
SERIAL_FOLDER = Path(__file__).parent / "registry" / "profiling"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stray = [item.nodeid for item in items
             if item.get_closest_marker("serial") is not None and SERIAL_FOLDER not in item.path.parents]
    if stray:
        raise pytest.UsageError(f"tests marked serial outside {SERIAL_FOLDER}: {', '.join(stray)}; make test runs "
                                "the serial ones from that folder only: move them there, or add the folder to "
                                "SERIAL_TESTS in the Makefile and here")
