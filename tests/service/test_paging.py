"""/matrix and /profiles: paged (limit, cursor), filtered (op, composite, status, stack), with ETag and 304."""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from fastapi.testclient import TestClient

import registry
from registry.core.sources import source_hashes
from registry.store.db import Store
from registry.store.records import MatrixEntry, ProfileEntry

# Each test that uses a store runs on SQLite and on PostgreSQL (tests/service/conftest.py).
STORE_BACKENDS = ("sqlite", "postgres")

HASHES = source_hashes()
STACKS = [(), ("vmap",), ("grad",), ("vmap", "grad"), ("vmap", "jvp")]


def _entries() -> list[MatrixEntry]:
    rows = []
    for op, composite in (("index_fill", "functional"), ("index_fill", "native"), ("masked_fill", "functional")):
        for stack in STACKS:
            for pattern in ("self", "all"):
                rows.append(MatrixEntry(op=op, composite=composite, kind=composite, stack=stack, pattern=pattern,
                                        dtype="float32", status="ok" if composite == "functional" else "error",
                                        detail="", max_abs_error=None, max_rel_error=None,
                                        source_hash=HASHES[(op, composite)], torch_version=torch.__version__,
                                        device="cpu"))
    return rows


def _fill(db_url: str, client: TestClient) -> None:
    generation = client.app.state.store_state.generation
    with Store(db_url) as store:
        store.write_entries(_entries())
        timing = ProfileEntry(op="to", composite="functional", kind="functional", stack=("vmap", "grad"),
                              workload="vmap(grad)", dtype="float32", device="cpu", device_name="cpu",
                              numel_bucket=1024, batch_size=32, valid=True, detail="", median_us=5.0, iqr_us=1.0,
                              runs=10, peak_memory=None, source_hash=HASHES[("to", "functional")],
                              torch_version=torch.__version__)
        store.write_profiles([timing, replace(timing, batch_size=64, valid=False, median_us=None)])
    deadline = time.monotonic() + 2
    while client.app.state.store_state.generation == generation:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_pages_cover_every_entry_once(serve, db_url: str) -> None:
    client: TestClient = serve()
    _fill(db_url, client)
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
        body = client.get("/matrix", params=params).json()
        assert body["total"] == 30 and len(body["items"]) <= 7
        seen += [(e["op"], e["composite"], e["stack"], e["pattern"]) for e in body["items"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert pages == 5 and len(seen) == len(set(seen)) == 30
    assert seen == sorted(seen, key=lambda k: (k[0], k[1], tuple(k[2].replace(")", "").split("(")) if k[2] else (),
                                               k[3]))


def test_filters_and_one_stack_spelling(serve, db_url: str) -> None:
    client: TestClient = serve()
    _fill(db_url, client)
    for stack in ("vmap(grad)", "vmap,grad"):
        body = client.get("/matrix", params={"op": "index_fill", "composite": "native", "stack": stack}).json()
        assert body["total"] == 2
        assert {(e["stack"], e["status"]) for e in body["items"]} == {("vmap(grad)", "error")}
    assert client.get("/matrix", params={"status": "error"}).json()["total"] == 10
    assert client.get("/matrix", params={"stack": ""}).json()["total"] == 6
    profiles = client.get("/profiles", params={"stack": "vmap,grad", "status": "valid"}).json()
    assert [(p["stack"], p["workload"], p["batch_size"]) for p in profiles["items"]] == [("vmap(grad)", "vmap(grad)",
                                                                                          32)]
    assert client.get("/profiles", params={"status": "invalid"}).json()["total"] == 1
    response = client.get("/matrix", params={"composite": "fancy"})
    assert response.status_code == 422
    # Every registered composite name, across ops (named ones such as batch_norm's batch_mean among the kinds).
    names = sorted({name for composites in registry.COMPOSITES.values() for name in composites})
    assert {"functional", "mutating", "native", "primitive"} <= set(names)
    assert response.json()["detail"] == f"no composite 'fancy'; composites: {', '.join(names)}"
    response = client.get("/matrix", params={"status": "great"})
    assert response.json()["detail"] == "unknown status 'great'; statuses are ok, slow, error, mismatch, unsupported"
    response = client.get("/matrix", params={"cursor": "not-a-cursor"})
    assert response.status_code == 422
    assert response.json()["detail"] == "cursor 'not-a-cursor' is not one this API gave out; start again without cursor"


def test_etag_and_304(serve, db_url: str) -> None:
    client: TestClient = serve()
    first = client.get("/matrix", params={"limit": 5})
    etag = first.headers["etag"]
    again = client.get("/matrix", params={"limit": 5}, headers={"If-None-Match": etag})
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etag)
    assert client.get("/matrix", params={"limit": 5}, headers={"If-None-Match": '"other"'}).status_code == 200
    _fill(db_url, client)  # new evidence: a new body, so a new tag
    changed = client.get("/matrix", params={"limit": 5}, headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert len(changed.json()["items"]) == 5


def test_jobs_take_both_stack_spellings(serve) -> None:
    client: TestClient = serve()
    runner = client.app.state.runner
    runner._run = lambda job, progress: {}
    verify = client.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap(grad)", "vmap,jvp"]}).json()
    assert verify["params"]["stacks"] == ["vmap(grad)", "vmap(jvp)"]  # one spelling in every output (issue 20)
    profile = client.post("/profiles", json={"ops": ["to"], "workloads": ["vmap,grad", "jacrev"]}).json()
    assert profile["params"]["workloads"] == ["vmap(grad)", "jacrev"]
    response = client.post("/profiles", json={"ops": ["to"], "workloads": ["vmap(jvp)"]})
    assert response.status_code == 422
    assert response.json()["detail"] == ("unknown workload 'vmap(jvp)'; workloads are vmap, grad, vmap(grad), jacrev, "
                                         "jacfwd, hessian")
    response = client.post("/profiles", json={"ops": ["to"], "device": "tpu"})
    assert response.json()["detail"].startswith("device 'tpu' is not on this host; profile on cpu")
