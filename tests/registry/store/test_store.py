from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from registry.core.status import STATUSES
from registry.reports.plots import render_matrix_png, stack_label
from registry.store.connection import default_url
from registry.store.db import Store
from registry.store.records import MatrixEntry

REPO_ROOT = Path(__file__).resolve().parents[2]


def entry(**overrides: Any) -> MatrixEntry:
    base = MatrixEntry(
        op="index_fill",
        composite="masked_where",
        kind="functional",
        stack=("vmap", "grad"),
        pattern="self",
        dtype="float32",
        status="ok",
        detail="",
        max_abs_error=1.5e-7,
        max_rel_error=2.5e-6,
        source_hash="abc123",
        torch_version="2.13.0",
        device="cpu",
    )
    return replace(base, **overrides)


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """An empty store, on SQLite and on PostgreSQL (the tests using it run once on each)."""
    s = Store(store_url)
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'm.db'}")
    yield s
    s.close()


def test_round_trip_keeps_every_field(store: Store) -> None:
    written = [
        entry(),
        entry(stack=(), pattern="all", status="error", detail="RuntimeError: boom", max_abs_error=None,
              max_rel_error=None),
        entry(stack=("vmap",), pattern="in_dims1", dtype="float64", status="unsupported", kind="inplace",
              max_abs_error=0.0, max_rel_error=None, device="cuda", measured_at=1_795_000_000.25),
    ]
    assert store.write_entries(written) == 3
    got = store.entries()
    assert sorted(got, key=repr) == sorted(written, key=repr)
    eager = [e for e in got if e.stack == ()]
    assert eager == [written[1]]
    assert eager[0].max_abs_error is None and eager[0].max_rel_error is None


def test_entries_are_ordered(store: Store) -> None:
    store.write_entries([
        entry(op="b", pattern="self"),
        entry(op="a", composite="z"),
        entry(op="a", composite="y", dtype="float64"),
        entry(op="a", composite="y", dtype="float32"),
        entry(op="a", composite="y", stack=()),
    ])
    keys = [(e.op, e.composite, ",".join(e.stack), e.pattern, e.dtype) for e in store.entries()]
    assert keys == sorted(keys)
    assert keys[0] == ("a", "y", "", "self", "float32")


def test_upsert_replaces_same_key(store: Store) -> None:
    store.write_entries([entry(status="error", detail="first"), entry(pattern="others")])
    store.write_entries([entry(status="ok", detail="second", max_abs_error=None)])
    got = store.entries(op="index_fill")
    assert len(got) == 2
    replaced = next(e for e in got if e.pattern == "self")
    assert (replaced.status, replaced.detail, replaced.max_abs_error) == ("ok", "second", None)
    # A different torch version or device is a different key, not a replacement.
    store.write_entries([entry(torch_version="2.14.0"), entry(device="cuda")])
    assert len(store.entries()) == 4


def test_upsert_within_one_batch_keeps_the_last(store: Store) -> None:
    assert store.write_entries([entry(detail="one"), entry(detail="two")]) == 2
    assert [e.detail for e in store.entries()] == ["two"]


def test_filters(store: Store) -> None:
    store.write_entries([
        entry(),
        entry(stack=()),
        entry(composite="scatter_based"),
        entry(op="masked_fill", composite="where"),
    ])
    assert {e.op for e in store.entries(op="masked_fill")} == {"masked_fill"}
    assert len(store.entries(op="index_fill")) == 3
    assert [e.stack for e in store.entries(stack=())] == [()]
    assert len(store.entries(stack=("vmap", "grad"))) == 3
    assert store.entries(stack=("grad", "vmap")) == []
    assert len(store.entries(op="index_fill", stack=("vmap", "grad"), composite="masked_where")) == 1
    assert store.entries(op="nope") == []


def test_fresh_entries_ignore_stale_rows(store: Store) -> None:
    store.write_entries([
        entry(),
        entry(composite="scatter_based", source_hash="old"),
        entry(composite="other", source_hash="h"),  # not in source_hashes: unknown composite
        entry(op="masked_fill", composite="where", source_hash="mf"),
        entry(torch_version="2.12.0"),
    ])
    hashes = {
        ("index_fill", "masked_where"): "abc123",
        ("index_fill", "scatter_based"): "new",
        ("masked_fill", "where"): "mf",
    }
    fresh = store.fresh_entries(source_hashes=hashes, torch_version="2.13.0")
    assert {(e.op, e.composite, e.torch_version) for e in fresh} == {
        ("index_fill", "masked_where", "2.13.0"),
        ("masked_fill", "where", "2.13.0"),
    }
    assert [e.op for e in store.fresh_entries(source_hashes=hashes, torch_version="2.13.0", op="masked_fill")] == [
        "masked_fill"
    ]
    assert store.fresh_entries(source_hashes=hashes, torch_version="9.9") == []
    assert len(store.entries()) == 5  # stale rows are ignored, not deleted


def test_invalid_status_raises_and_writes_nothing(store: Store) -> None:
    store.write_entries([entry(detail="earlier")])
    batch = [entry(pattern="others"), entry(pattern="all"), entry(detail="replacement"), entry(status="broken")]
    with pytest.raises(ValueError, match="broken") as info:
        store.write_entries(batch)
    for status in STATUSES:
        assert status in str(info.value)
    assert store.entries() == [entry(detail="earlier")]


def test_failure_inside_transaction_rolls_back(store: Store) -> None:
    store.write_entries([entry(detail="earlier")])

    def batch() -> Iterator[MatrixEntry]:
        yield entry(pattern="others")
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError):
        store.write_entries(batch())
    assert store.entries() == [entry(detail="earlier")]


def test_clear_and_empty_write(store: Store) -> None:
    assert store.write_entries([]) == 0
    store.write_entries([entry(), entry(stack=())])
    store.clear()
    assert store.entries() == []


def test_data_persists_across_stores(store_url: str) -> None:
    url = store_url
    with Store(url) as first:
        first.write_entries([entry()])
    with Store(url) as second:
        assert second.entries() == [entry()]


def test_sqlite_uses_wal(sqlite_store: Store) -> None:
    with sqlite_store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0


def test_integrity_ok(store: Store) -> None:
    store.write_entries([entry()])
    assert store.integrity_ok()


def test_default_url_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MULTICOMPOSITE_DB", "sqlite:///elsewhere.db")
    assert default_url() == "sqlite:///elsewhere.db"


def test_default_url_uses_xdg_data_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MULTICOMPOSITE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    folder = tmp_path / "data" / "multicomposite"
    assert default_url() == f"sqlite:///{folder / 'multicomposite.db'}"
    assert folder.is_dir()
    with Store() as s:
        s.write_entries([entry()])
    assert (folder / "multicomposite.db").is_file()


def test_default_url_falls_back_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MULTICOMPOSITE_DB", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_url() == f"sqlite:///{tmp_path / '.local' / 'share' / 'multicomposite' / 'multicomposite.db'}"


def test_invalid_stack_name_rejected(store: Store) -> None:
    with pytest.raises(ValueError):
        store.write_entries([entry(stack=("vmap,grad",))])
    assert store.entries() == []


BATCH = 25
WRITER = textwrap.dedent(
    """
    import sys
    from registry.store.records import MatrixEntry
    from registry.store.db import Store

    store = Store(sys.argv[1])
    batch = 0
    while True:
        store.write_entries(
            MatrixEntry(op=f"op{i % 5}", composite="c", kind="functional", stack=("vmap",), pattern=f"p{batch}-{i}",
                        dtype="float32", status="ok", detail=f"batch-{batch}", max_abs_error=None, max_rel_error=None,
                        source_hash="h", torch_version="t", device="cpu")
            for i in range({batch_size})
        )
        if batch == 0:
            print("ready", flush=True)
        batch += 1
    """
).replace("{batch_size}", str(BATCH))


def test_killed_writer_leaves_consistent_store(store_url: str) -> None:
    url = store_url
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # Wait until the first batch is committed (importing registry pulls torch in, which takes seconds).
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "writer did not start"
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "ready", proc.stderr.read() if proc.poll() is not None else line  # type: ignore[union-attr]
        time.sleep(0.5)
        assert proc.poll() is None, "writer exited on its own"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL

    with Store(url) as store:
        assert store.integrity_ok()
        counts = Counter(e.detail for e in store.entries())
        assert counts["batch-0"] == BATCH
        assert len(counts) >= 2, "expected several batches before the kill"
        incomplete = {marker: n for marker, n in counts.items() if n != BATCH}
        assert not incomplete, f"partial batches survived: {incomplete}"
        # The store stays writable after the crash.
        assert store.write_entries([entry()]) == 1


def test_stack_label() -> None:
    assert stack_label(()) == "eager"
    assert stack_label(("vmap",)) == "vmap"
    assert stack_label(("vmap", "grad")) == "vmap(grad)"
    assert stack_label(("vmap", "vmap", "grad")) == "vmap(vmap(grad))"


def test_render_matrix_png(tmp_path: Path) -> None:
    entries = [
        entry(),
        entry(pattern="others", status="slow"),
        entry(stack=(), status="ok"),
        entry(composite="scatter_based", status="mismatch", dtype="float64"),
        entry(composite="scatter_based", stack=("vmap",), status="error"),
        entry(op="masked_fill", composite="where", stack=("grad",), status="unsupported"),
    ]
    out = render_matrix_png(entries, tmp_path / "plots" / "matrix.png", title="test matrix")
    assert out == tmp_path / "plots" / "matrix.png"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1024


def test_render_matrix_png_large(tmp_path: Path) -> None:
    stacks = [(f"t{i}",) for i in range(60)]
    entries = [
        entry(op=f"op{r}", composite="comp", stack=stack, status=STATUSES[(r + c) % len(STATUSES)])
        for r in range(30)
        for c, stack in enumerate(stacks)
        if (r * c) % 7
    ]
    out = render_matrix_png(entries, str(tmp_path / "big.png"))
    assert out.read_bytes().startswith(b"\x89PNG")


def test_render_matrix_png_rejects_empty(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no entries to plot"):
        render_matrix_png([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_importing_registry_store_does_not_import_matplotlib() -> None:
    code = "import sys, registry.store.db, registry.reports.plots; print('matplotlib' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
