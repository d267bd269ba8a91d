"""Defect 1: after another process writes the store, a running server kept answering "unverified: no measurement
yet" until restarted, and two servers on one store answered differently."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from registry.core.sources import source_hashes
from registry.store.db import Store
from registry.store.records import ProfileEntry

ROOT = Path(__file__).resolve().parents[2]
QUERY = {"op": "masked_fill", "stack": "vmap", "batched": "self", "dtype": "float32"}

# Each test that uses a store runs on SQLite and on PostgreSQL (tests/service/conftest.py).
STORE_BACKENDS = ("sqlite", "postgres")

# Another process writes what `multicomposite verify` would for this context: functional ok under vmap.
WRITER = textwrap.dedent("""
    import sys, torch
    from registry.core.sources import source_hashes
    from registry.store.records import MatrixEntry
    from registry.store.db import Store
    hashes = source_hashes()
    with Store(sys.argv[1]) as store:
        store.write_entries([MatrixEntry(
            op="masked_fill", composite="functional", kind="functional", stack=("vmap",), pattern=pattern,
            dtype="float32", status="ok", detail="", max_abs_error=0.0, max_rel_error=0.0,
            source_hash=hashes[("masked_fill", "functional")], torch_version=torch.__version__, device="cpu")
            for pattern in ("self", "all")])
""")


@pytest.fixture(autouse=True)
def _no_reference_profiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The rules alone decide before the write (the shipped reference profiles would rank masked_fill's composites
    already): what the tests watch is the store's evidence arriving."""
    from registry.core import reference, selector

    monkeypatch.setattr(reference, "PATH", tmp_path / "no_reference_profiles.json")
    selector.clear_cache()


def _until(check, timeout: float) -> float:
    """Seconds until ``check()`` is true; AssertionError after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_write_by_another_process_shows_within_a_second(serve, db_url: str) -> None:
    first: TestClient = serve(evidence_poll_s=0.25)
    second: TestClient = serve(evidence_poll_s=0.25)
    before = first.get("/select", params=QUERY).json()["reason"]
    assert before.endswith("(unverified: no measurement yet, rules decide).")
    assert second.get("/select", params=QUERY).json()["reason"] == before
    subprocess.run([sys.executable, "-c", WRITER, db_url], check=True, cwd=ROOT, timeout=120)
    written = time.monotonic()
    expected = "(verified: 1 matrix entry ok here)."  # pattern self applies here; "1 matrix entries" before
    for client in (first, second):
        _until(lambda client=client: client.get("/select", params=QUERY).json()["reason"].endswith(expected), 1.0)
    assert time.monotonic() - written < 1.0
    # Both servers answer the same, and the matrix route shows the rows too.
    assert first.get("/select", params=QUERY).json() == second.get("/select", params=QUERY).json()
    assert first.get("/matrix", params={"op": "masked_fill"}).json()["total"] == 2


def test_profiles_written_elsewhere_change_the_choice_and_its_speedup(serve, db_url: str) -> None:
    client: TestClient = serve()
    query = {"op": "index_add", "stack": "vmap", "batched": "self,source", "dtype": "float32", "numel": 1000}
    assert client.get("/select", params=query).json()["speedup"] is None
    hashes = source_hashes()

    def timing(composite: str, median: float) -> ProfileEntry:
        return ProfileEntry(op="index_add", composite=composite, kind=composite, stack=("vmap",), workload="vmap",
                            dtype="float32", device="cpu", device_name="cpu", numel_bucket=1024, batch_size=32,
                            valid=True, detail="", median_us=median, iqr_us=1.0, runs=10, peak_memory=None,
                            source_hash=hashes[("index_add", composite)], torch_version=torch.__version__)

    with Store(db_url) as store:
        store.write_profiles([timing("native", 30.0), timing("functional", 10.0), timing("primitive", 40.0)])
    _until(lambda: client.get("/select", params=query).json()["composite"] == "functional", 1.0)
    body = client.get("/select", params=query).json()
    assert (body["speedup"], body["runner_up_speedup"]) == (3.0, 3.0)
    assert "(3.00x faster than native; profiled at 1024 elements, batch 32)" in body["reason"]


def test_a_server_started_before_the_cli_verify_answers_from_its_results(tmp_path: Path) -> None:
    """The issue's "done when": a real server, then `multicomposite verify` in another process."""
    import os
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": f"sqlite:///{tmp_path / 's.db'}"}
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/select"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                before = httpx.get(url, params=QUERY, timeout=5).json()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.3)
        # (a server in its own process: the shipped reference profiles may rank the composites already)
        assert "(unverified: no measurement yet, " in before["reason"]
        subprocess.run([sys.executable, "-m", "service.cli", "verify", "--op", "masked_fill", "--stack", "vmap",
                        "--dtype", "float32", "--json"], env=env, check=True, capture_output=True, timeout=300)
        seconds = _until(lambda: "(verified: " in httpx.get(url, params=QUERY, timeout=5).json()["reason"], 1.0)
        assert seconds < 1.0
    finally:
        server.terminate()
        server.wait(20)
