"""The store's generation (what a server compares to see new evidence), the one stack spelling in its rows, and
job rows."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import text

from registry.store.connection import StoreUnavailableError
from registry.store.db import Store
from registry.store.records import JobRecord
from tests.registry.store.test_store import entry


def test_every_evidence_write_bumps_the_generation(store_url: str) -> None:
    writer, reader = Store(store_url), Store(store_url)
    assert reader.generation() == 0
    writer.write_entries([entry()])
    assert reader.generation() == 1
    writer.write_entries([])  # nothing written: nothing to reload
    assert reader.generation() == 1
    writer.clear()
    assert reader.generation() == 2
    writer.add_job(JobRecord(id="j", kind="verify", params={}))  # jobs are not evidence
    assert reader.generation() == 2
    writer.close()
    reader.close()


def test_stacks_are_stored_in_one_spelling(store_url: str) -> None:
    """Rows of the old spelling (vmap,grad) are rewritten by the baseline migration: test_migrations.py."""
    with Store(store_url) as store:
        store.write_entries([entry(stack=("vmap", "grad"))])
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT stack FROM matrix_entries")).all() == [("vmap(grad)",)]
        assert [e.stack for e in store.entries(stack=("vmap", "grad"))] == [("vmap", "grad")]


def test_check_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    store = Store(f"sqlite:///{path}")
    store.check()
    # Another file put in its place. (An overwrite in place shows only once SQLite reads the overwritten pages:
    # while its -wal holds them it reads them from there, and looking at the bytes ourselves would drop its locks.)
    wrong = tmp_path / "wrong.db"
    wrong.write_bytes(b"garbage" * 10)
    wrong.replace(path)
    with pytest.raises(StoreUnavailableError, match=f"^the store file {path} is not a SQLite database"):
        store.check()
    path.unlink()
    with pytest.raises(StoreUnavailableError, match=f"^the store file {path} does not exist$"):
        store.check()
    store.close()


def test_job_rows(store_url: str) -> None:
    store = Store(store_url)
    store.add_job(JobRecord(id="a", kind="profile", params={"ops": ["to"]}, owner="h:1"))
    store.update_job("a", state="running", done=1, total=4, started_at=time.time())
    assert store.cancel_job("a").state == "cancelling"  # its runner stops it at the next case boundary
    assert not store.update_job("a", if_state=("running",), done=2)  # the runner's progress write sees it
    assert store.update_job("a", if_state=("running", "cancelling"), state="done", result={"profiles": 4},
                            finished_at=time.time())
    assert store.cancel_job("a").state == "done"  # a finished job stays as it is
    job = store.job("a")
    assert (job.state, job.done, job.total, job.params, job.result) == ("done", 1, 4, {"ops": ["to"]},
                                                                       {"profiles": 4})
    store.add_job(JobRecord(id="b", kind="verify", params={}))
    assert store.cancel_job("b").state == "cancelled"
    assert store.job_counts() == {"done": 1, "cancelled": 1}
    assert store.prune_jobs(time.time() + 1) == 2
    assert store.jobs() == []
    store.close()


def test_a_job_is_claimed_once_and_written_only_by_its_owner(store_url: str) -> None:
    """What a worker does with a job's row: claim it (queued -> running, its count reset), then write it only while
    it still owns it."""
    with Store(store_url) as store:
        store.add_job(JobRecord(id="q", kind="verify", params={}, done=3, total=8, error="retry 2 of 2: ..."))
        claimed = store.claim_job("q", "w1")
        assert claimed is not None
        assert (claimed.state, claimed.owner, claimed.done, claimed.total, claimed.error) == (
            "running", "w1", 0, 0, "retry 2 of 2: ...")
        assert claimed.started_at is not None
        assert store.claim_job("q", "w2") is None  # taken already
        assert not store.update_job("q", if_state=("running",), if_owner="w2", done=1)
        assert store.update_job("q", if_state=("running",), if_owner="w1", done=1, total=2)
        assert store.update_job("q", if_owner="w1", state="done", result={"ran": "q"})
        job = store.job("q")
        assert (job.state, job.done, job.total, job.owner, job.result) == ("done", 1, 2, "w1", {"ran": "q"})
        assert store.claim_job("q", "w1") is None  # finished
        store.add_job(JobRecord(id="c", kind="verify", params={}))
        store.cancel_job("c")
        assert store.claim_job("c", "w1") is None  # cancelled before it was fetched
        assert store.job("c").state == "cancelled"
