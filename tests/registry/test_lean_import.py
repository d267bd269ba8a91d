"""Nothing heavy on the hot path: ``import registry`` and the first routed call inside ``use()`` load the core only.

The service's libraries, the verification harness, PyTorch's OpInfo database, Dynamo and sympy load for verify,
survey and profile, never for a library user's ``use()``. Checked in a fresh interpreter (this one has imported
everything the other tests need) by the names in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# The store's modules that build on SQLAlchemy (sqlite_reader, records and connection do not).
STORE_ON_SQLALCHEMY = ("registry.store.db", "registry.store.database", "registry.store.tables",
                       "registry.store.evidence_store", "registry.store.job_store")
# Not torch.testing._internal itself: torch imports its common_dtype and logging_tensor.
HEAVY = ("sqlalchemy", "alembic", "fastapi", "uvicorn", "pydantic", "matplotlib", "procrastinate", "psycopg", "rich",
         "sympy", "torch._dynamo", "torch.testing._internal.opinfo",
         "torch.testing._internal.common_methods_invocations", "registry.harness", *STORE_ON_SQLALCHEMY,
         "registry.profiling", "registry.reports", "service")

PROBE = textwrap.dedent("""
    import json, sys
    heavy = {heavy!r}
    def loaded():
        return sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
    import torch
    import registry
    after_import = loaded()
    x = torch.randn(4, 5)
    index = torch.tensor([0, 2])
    with registry.use():
        torch.func.vmap(lambda row: torch.index_fill(row, 0, index, 1.0))(x)
        assert registry.routing_active()
    print(json.dumps({{"after_import": after_import, "after_first_call": loaded()}}))
""")


def _probe(tmp_path: Path, **env: str) -> dict[str, list[str]]:
    clean = {k: v for k, v in os.environ.items() if k != "MULTICOMPOSITE_DB"}
    clean.update({"XDG_DATA_HOME": str(tmp_path), **env})
    finished = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY)], capture_output=True, text=True,
                              env=clean, timeout=300, check=False)
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout.splitlines()[-1])


def test_import_and_first_routed_call_load_nothing_heavy(tmp_path: Path) -> None:
    loaded = _probe(tmp_path)
    assert loaded == {"after_import": [], "after_first_call": []}


def test_a_store_at_the_newest_schema_is_read_without_sqlalchemy(tmp_path: Path) -> None:
    # With a SQLite store at the newest revision, the first decision reads its evidence with the standard library.
    pytest.importorskip("sqlalchemy")
    from registry.store.db import Store

    url = f"sqlite:///{tmp_path / 'store.db'}"
    Store(url).close()
    loaded = _probe(tmp_path, MULTICOMPOSITE_DB=url)
    assert loaded == {"after_import": [], "after_first_call": []}


def test_an_older_store_is_migrated_without_the_harness(tmp_path: Path) -> None:
    # A store below the newest revision is opened through Store, which migrates it: SQLAlchemy and Alembic load
    # then, but still no harness, OpInfo, Dynamo or service.
    pytest.importorskip("sqlalchemy")
    from registry.store import migrate

    url = f"sqlite:///{tmp_path / 'store.db'}"
    migrate.upgrade(url, migrate.revisions()[-2])
    loaded = _probe(tmp_path, MULTICOMPOSITE_DB=url)
    assert loaded["after_import"] == []
    assert "sqlalchemy" in loaded["after_first_call"]
    assert [m for m in loaded["after_first_call"]
            if not m.startswith(("sqlalchemy", "alembic", *STORE_ON_SQLALCHEMY))] == []
