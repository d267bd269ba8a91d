"""The standard-library reader of a SQLite store's evidence: the same records, in the same order, as ``Store``
reads, and no answer (so ``Store`` is used) where it cannot tell."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from registry.store import migrate, sqlite_reader
from registry.store.db import Store
from registry.store.records import MatrixEntry, ProfileEntry

HASHES = {("index_add", "native"): "h-native", ("index_add", "functional"): "h-functional"}


def _entry(composite: str, stack: tuple[str, ...], status: str, **changes: object) -> MatrixEntry:
    entry = MatrixEntry(op="index_add", composite=composite, kind=composite, stack=stack, pattern="all",
                        dtype="float32", status=status, detail="" if status == "ok" else "wrong values",
                        max_abs_error=None if status == "ok" else 2.0, max_rel_error=None,
                        source_hash=f"h-{composite}", torch_version="2.13.0", device="cpu", measured_at=1.5e9)
    return replace(entry, **changes)


def _profile(composite: str, batch: int, median: float, **changes: object) -> ProfileEntry:
    profile = ProfileEntry(op="index_add", composite=composite, kind=composite, stack=("vmap",), workload="vmap",
                           dtype="float32", device="cpu", device_name="cpu", numel_bucket=1024, batch_size=batch,
                           valid=True, detail="", median_us=median, iqr_us=1.0, runs=10, peak_memory=None,
                           source_hash=f"h-{composite}", torch_version="2.13.0")
    return replace(profile, **changes)


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with Store(url) as store:
        store.write_entries([_entry("native", ("vmap", "grad"), "mismatch"), _entry("functional", ("vmap",), "ok"),
                             _entry("native", ("vmap",), "ok", source_hash="stale"),
                             _entry("functional", ("grad",), "ok", torch_version="2.12.0")])
        store.write_profiles([_profile("native", 32, 10.0), _profile("functional", 1, 4.0),
                              _profile("functional", 32, 5.0, valid=False, median_us=None, iqr_us=None, runs=0),
                              _profile("native", 1, 3.0, torch_version="2.12.0")])
    return url


def test_head_revision_is_alembics() -> None:
    assert sqlite_reader.head_revision() == migrate.head()


def test_it_reads_what_store_reads(url: str) -> None:
    with Store(url) as store:
        entries = store.fresh_entries(source_hashes=HASHES, torch_version="2.13.0")
        profiles = store.fresh_profiles(source_hashes=HASHES, torch_version="2.13.0")
    assert [(e.composite, e.stack, e.status) for e in entries] == [("functional", ("vmap",), "ok"),
                                                                   ("native", ("vmap", "grad"), "mismatch")]
    assert sqlite_reader.fresh_entries(url, source_hashes=HASHES, torch_version="2.13.0") == entries
    assert [(p.composite, p.batch_size, p.valid) for p in profiles] == [("functional", 1, True),
                                                                        ("functional", 32, False),
                                                                        ("native", 32, True)]
    assert sqlite_reader.fresh_profiles(url, source_hashes=HASHES, torch_version="2.13.0") == profiles


def test_no_answer_where_it_cannot_tell(url: str, tmp_path: Path) -> None:
    hashes = dict(source_hashes=HASHES, torch_version="2.13.0")
    assert sqlite_reader.fresh_entries("postgresql://host/db", **hashes) is None
    assert sqlite_reader.fresh_entries("sqlite:///:memory:", **hashes) is None
    assert sqlite_reader.fresh_entries(f"sqlite:///{tmp_path / 'missing.db'}", **hashes) is None
    (tmp_path / "text.db").write_text("not a database")
    assert sqlite_reader.fresh_profiles(f"sqlite:///{tmp_path / 'text.db'}", **hashes) is None
    older = f"sqlite:///{tmp_path / 'older.db'}"
    migrate.upgrade(older, migrate.revisions()[-2])
    assert sqlite_reader.fresh_entries(older, **hashes) is None  # Store migrates it first
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '9999'")
    assert sqlite_reader.fresh_profiles(url, **hashes) is None  # newer than this code: Store says so


def test_the_default_store_is_read_with_it(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.store import evidence

    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    monkeypatch.setattr(evidence, "source_hashes", lambda: HASHES)
    monkeypatch.setattr("torch.__version__", "2.13.0")

    def no_store(*args: object, **kwargs: object) -> None:
        raise AssertionError("EvidenceStore opened for a store at the newest revision")

    monkeypatch.setattr("registry.store.evidence_store.EvidenceStore", no_store)
    assert [e.status for e in evidence.stored_entries()] == ["ok", "mismatch"]
    assert [p.median_us for p in evidence.stored_profiles()] == [4.0, None, 10.0]
