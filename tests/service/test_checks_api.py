"""POST /checks runs a built-in program through registry.check as a job; the report is stored and served by GET
/checks and GET /checks/{id}; nothing but a shipped example can be named."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from service.check_examples import EXAMPLES

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def client(serve) -> TestClient:
    return serve(token="s3cret", queue_size=2)


def _wait(client: TestClient, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {job}")


def test_a_check_job_stores_its_report(client: TestClient) -> None:
    response = client.post("/checks", json={"example": "index-fill", "rounds": 1}, headers=AUTH)
    assert response.status_code == 202
    job_id = response.json()["id"]
    assert response.headers["Location"] == f"/jobs/{job_id}"
    job = _wait(client, job_id)
    assert job["state"] == "done", job
    assert job["kind"] == "check"
    assert job["result"] == {"check": job_id, "native": "mismatch", "use": "ok", "ok": True}
    listed = client.get("/checks").json()
    assert [(c["id"], c["example"], c["native_verdict"], c["use_verdict"], c["report"]) for c in listed] == [
        (job_id, "index-fill", "mismatch", "ok", None)]
    stored = client.get(f"/checks/{job_id}").json()
    assert stored["transform"] == "vmap(grad)" and stored["policy"] == "auto"
    assert stored["summary"].startswith("native is silently wrong")
    assert stored["report"]["decisions"][0]["op"] == "index_fill"
    assert stored["use_s"] == stored["report"]["use"]["time_s"] > 0
    assert stored["created_at"].endswith("Z")


def test_only_shipped_examples_and_the_token(client: TestClient) -> None:
    assert client.post("/checks", json={"example": "index-fill"}).status_code == 401
    response = client.post("/checks", json={"example": "/etc/passwd"}, headers=AUTH)
    assert response.status_code == 404
    assert response.json()["detail"] == f"no example '/etc/passwd'; examples: {', '.join(EXAMPLES)}"
    refused = client.post("/checks", json={"example": "index-fill", "source": "import os"}, headers=AUTH)
    assert refused.status_code == 422  # no field takes code
    assert client.post("/checks", json={"example": "index-fill", "rounds": 0}, headers=AUTH).status_code == 422
    assert client.get("/checks/nope").status_code == 404
    examples = client.get("/checks/examples").json()
    assert [e["name"] for e in examples] == list(EXAMPLES)
    assert {e["name"]: e["transform"] for e in examples}["pinn-hessian"] == "vmap(hessian)"
