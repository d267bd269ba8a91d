"""Jobs, auth, limits, batch select, metrics, and the real server process."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from registry.core import kernels
from registry.store.connection import StoreUnavailableError
from service.main import create_app
from service.settings import Settings

FASTEST_FUSED = "cpp_op" if kernels.fused_ops_available() else "primitive"

# Each test that uses a store runs on SQLite and on PostgreSQL (tests/service/conftest.py).
STORE_BACKENDS = ("sqlite", "postgres")

ROOT = Path(__file__).resolve().parents[2]


def _wait(client: TestClient, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {job}")


@pytest.fixture
def client(serve) -> TestClient:
    return serve(token="s3cret", queue_size=2, max_contexts=64, max_body_bytes=4096)


AUTH = {"Authorization": "Bearer s3cret"}


def test_post_routes_need_the_token_get_routes_do_not(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = client.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap"]}, headers=headers)
        assert response.status_code == 401
        assert response.json() == {"detail": "this route needs the header Authorization: Bearer <token>"}
    assert client.delete("/jobs/x").status_code == 401


def test_verify_job_runs_and_fills_the_matrix(client: TestClient) -> None:
    response = client.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap"]}, headers=AUTH)
    assert response.status_code == 202
    job_id = response.json()["id"]
    assert response.headers["Location"] == f"/jobs/{job_id}"
    job = _wait(client, job_id)
    assert job["state"] == "done", job
    assert job["result"]["entries"] == job["total"] > 0
    time.sleep(0.3)  # the watcher sees the new generation
    matrix = client.get("/matrix", params={"op": "masked_fill", "stack": "vmap"}).json()["items"]
    assert any(e["composite"] == "native" and e["status"] == "slow" for e in matrix)


def test_profile_job_changes_profiles_and_select(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job -> store -> /profiles -> /select flow. The noise control, which refuses a disturbed context (tested in
    tests/registry/profiling/test_noise.py), is off here: a loaded machine must not leave nothing to read back."""
    from registry.profiling import timing

    monkeypatch.setattr(timing, "profile", functools.partial(timing.profile, spread_limit=float("inf")))
    body = {"ops": ["index_add"], "workloads": ["vmap"], "batch_sizes": [8], "numels": [256], "min_run_time": 0.05}
    job = _wait(client, client.post("/profiles", json=body, headers=AUTH).json()["id"])
    assert job["state"] == "done", job
    assert job["result"]["refused"] == [], job
    deadline = time.monotonic() + 5  # the watcher sees the new generation within a poll (0.25 s) when not loaded
    while True:
        profiles = client.get("/profiles", params={"op": "index_add", "stack": "vmap"}).json()["items"]
        if profiles or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    built = {"cpp_op"} if kernels.fused_ops_available() else set()  # index_add's rows op, where it is built
    assert {p["composite"] for p in profiles} == {"native", "mutating", "functional", "primitive"} | built, \
        job["result"]
    decision = client.get("/select", params={"op": "index_add", "stack": "vmap", "batched": "self,source",
                                             "dtype": "float32", "numel": 256}).json()
    # The decision reads the job's profiles: either they rank a fastest composite, or (native and functional are
    # close for index_add under vmap) they cannot tell the rules' choice from it beyond the measured noise.
    assert "profiled at 256 elements, batch 8" in decision["reason"], decision["reason"]
    if "fastest valid composite measured" in decision["reason"]:
        assert decision["speedup"] > 0 and decision["runner_up_speedup"] >= 1
    else:
        assert "the profiles do not tell it from the fastest" in decision["reason"], decision["reason"]


def test_job_errors_and_limits(client: TestClient) -> None:
    response = client.post("/verify", json={"ops": ["nope"]}, headers=AUTH)
    assert response.status_code == 404
    assert response.json()["detail"].startswith("unknown op 'nope'")
    response = client.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap,gard"]}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"].startswith("unknown transform 'gard'")
    response = client.post("/profiles", json={"batch_sizes": [100000]}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"] == "batch size 100000 is outside 1..1024 (max_batch)"
    response = client.post("/verify", json={}, headers=AUTH)
    assert response.status_code == 422
    assert "over the limit of 64 per job" in response.json()["detail"]
    response = client.post("/select", content=b"[" + b" " * 5000 + b"]", headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"detail": "request body of 5002 bytes is over the limit of 4096"}
    assert client.get("/jobs/nope").json() == {"detail": "no job 'nope'"}


def test_queue_full_cancel_and_metrics(serve) -> None:
    release = threading.Event()
    client = serve(queue_size=1)
    runner = client.app.state.runner
    runner._run = lambda job, progress: (release.wait(30), {"ok": True})[1]  # a job that waits for the test
    body = {"ops": ["masked_fill"], "stacks": ["vmap"]}
    first = client.post("/verify", json=body).json()["id"]
    deadline = time.monotonic() + 10
    while client.get(f"/jobs/{first}").json()["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    second = client.post("/verify", json=body).json()["id"]
    full = client.post("/verify", json=body)
    assert full.status_code == 429 and full.headers["Retry-After"] == "30"
    assert client.delete(f"/jobs/{second}").json()["state"] == "cancelled"
    # Defect 7: the cancelled job kept its slot, and this was 429 too.
    third = client.post("/verify", json=body)
    assert third.status_code == 202, third.json()
    # Running: cancelling, until its next case boundary; this job reports none, so it ends done all the same.
    cancelling = client.delete(f"/jobs/{first}")
    assert (cancelling.status_code, cancelling.json()["state"]) == (202, "cancelling")
    release.set()
    assert _wait(client, first)["state"] == "done"
    assert _wait(client, third.json()["id"])["state"] == "done"
    conflict = client.delete(f"/jobs/{first}")
    assert conflict.status_code == 409
    assert conflict.json() == {"detail": f"job {first} is done already; only a queued or running job can be "
                                         "cancelled"}
    metrics = client.get("/metrics").text
    assert 'multicomposite_jobs{state="cancelled"} 1.0' in metrics
    assert 'multicomposite_requests_total{method="POST",route="/verify",status="429"} 1.0' in metrics


def test_an_unreachable_store_refuses_the_start(tmp_path) -> None:
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}"))
    with pytest.raises(StoreUnavailableError, match="cannot be opened: OperationalError"), TestClient(app):
        pass


def test_batch_select(client: TestClient, serve) -> None:
    queries = [{"op": "masked_scatter", "stack": "vmap"}, {"op": "index_add", "stack": "grad"}]
    answers = client.post("/select", json=queries).json()
    # masked_scatter under vmap: the shipped reference profiles rank its C++ op fastest, where it is built (make test
    # builds it), then its primitive (nothing measured here)
    assert [a["composite"] for a in answers] == [FASTEST_FUSED, "native"]
    response = client.post("/select", json=[{"op": "index_add"}, {"op": "nope"}])
    assert response.status_code == 404
    assert response.json()["detail"].startswith("query 1: unknown op 'nope'")
    response = serve().post("/select", json=[{"op": "index_add"}] * 257)
    assert response.status_code == 422
    assert response.json() == {"detail": "body: List should have at most 256 items after validation, not 257"}


def test_real_server_process(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": f"sqlite:///{tmp_path / 's.db'}"}
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.3)
        assert health.json() == {"status": "ok"}
        decision = httpx.get(f"http://127.0.0.1:{port}/select", params={"op": "index_fill", "stack": "vmap(jvp)"})
        assert decision.json()["composite"] == "functional"
    finally:
        server.terminate()
        server.wait(20)
