from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from service.cli import main

# Each test that uses a store runs on SQLite and on PostgreSQL (tests/service/conftest.py).
STORE_BACKENDS = ("sqlite", "postgres")


@pytest.fixture
def client(serve) -> TestClient:
    return serve()


def test_healthz_readyz_and_version(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}
    assert client.get("/version").json()["torch"].startswith("2.")


def test_ops(client: TestClient) -> None:
    ops = {op["name"]: op for op in client.get("/ops").json()}
    assert set(ops) == {"index_add", "index_copy", "index_fill", "masked_fill", "masked_scatter", "contiguous", "to"}
    assert [c["kind"] for c in ops["index_fill"]["composites"]] == ["native", "mutating", "functional", "primitive"]
    detail = client.get("/ops/masked_scatter").json()
    assert "torch.Tensor.masked_scatter" in detail["entry_points"]
    assert "class" not in detail["composites"][2]["source"] and "def masked_scatter_functional" in \
        detail["composites"][2]["source"]


def test_ops_show_package_relative_paths(client: TestClient) -> None:
    # Defect 11: absolute install paths (/home/..., site-packages) were shown.
    wheres = [c["where"] for c in client.get("/ops/masked_scatter").json()["composites"]]
    assert all(re.fullmatch(r"composites/masked\.py:\d+", where) for where in wheres[1:]), wheres


def test_select(client: TestClient) -> None:
    body = client.get("/select", params={"op": "index_fill", "stack": "vmap,grad"}).json()
    assert (body["composite"], body["kind"]) == ("functional", "functional")
    assert body["stack"] == "vmap(grad)"
    assert (body["speedup"], body["runner_up_speedup"]) == (None, None)
    assert {a["composite"]: a["ok"] for a in body["alternatives"]} == {
        "native": False, "mutating": False, "primitive": True}


def test_select_schema_has_the_speedups(client: TestClient) -> None:
    # Defect 5: speedup and runner_up_speedup were missing from /select and its schema.
    schema = client.get("/openapi.json").json()["components"]["schemas"]["DecisionPublic"]
    assert {"speedup", "runner_up_speedup"} <= set(schema["required"])
    assert schema["properties"]["speedup"]["anyOf"] == [{"type": "number"}, {"type": "null"}]


def test_errors_say_what_to_fix(client: TestClient) -> None:
    response = client.get("/ops/index_fil")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("unknown op 'index_fil'; did you mean index_fill")
    response = client.get("/select", params={"op": "index_fill", "stack": "vmap,gard"})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "unknown transform 'gard' in stack 'vmap(gard)'; valid: vmap, grad, jvp, functionalize, autograd, compile, "
        "jacrev, jacfwd, hessian"
    )
    response = client.get("/select", params={"op": "index_fill", "stack": "vmap", "pin": "mutating"})
    assert response.status_code == 422
    assert response.json()["detail"].endswith("valid choices: functional, primitive")


def test_docs_are_served_without_a_cdn(client: TestClient) -> None:
    # Defect 11: /docs loaded Swagger UI from a CDN and was blank offline.
    for page, asset in (("/docs", "/static/swagger-ui-bundle.js"), ("/redoc", "/static/redoc.standalone.js")):
        html = client.get(page).text
        assert asset in html
        assert "http://" not in html and "https://" not in html, page
        response = client.get(asset)
        assert response.status_code == 200 and len(response.content) > 100_000
    assert client.get("/static/swagger-ui.css").status_code == 200


def test_cli_select(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "masked_scatter", "--stack", "vmap(grad)"]) == 0
    out = capsys.readouterr().out
    assert '"composite": "functional"' in out and '"stack": "vmap(grad)"' in out
    assert main(["select", "nope"]) == 2
    assert capsys.readouterr().err.startswith("multicomposite select: unknown op 'nope'")


def test_matrix_and_profiles_read_the_store(client: TestClient, db_url: str) -> None:
    import time

    import torch

    from registry.harness.verify import verify
    from registry.profiling.timing import profile
    from registry.store.db import Store

    with Store(db_url) as store:
        store.write_entries(verify(ops=["masked_fill"], stacks=["vmap"], dtypes=(torch.float32,),
                                   composites=["native", "functional"]))
        # What the API reads back, not the noise control: a 10 ms run on a loaded machine is always disturbed.
        store.write_profiles(profile(ops=["masked_fill"], workloads=["vmap"], batch_sizes=(4,), numels=(64,),
                                     min_run_time=0.01, spread_limit=float("inf")))
    time.sleep(0.3)  # the watcher sees the new generation
    functional = client.get("/ops/masked_fill").json()["composites"][2]
    assert functional["name"] == "functional" and "vmap" in functional["verified"]
    matrix = client.get("/matrix", params={"op": "masked_fill", "stack": "vmap"}).json()["items"]
    assert {(e["composite"], e["pattern"]) for e in matrix} >= {("functional", "all"), ("native", "others")}
    assert all(e["status"] == "ok" for e in matrix if e["composite"] == "functional")
    profiles = client.get("/profiles", params={"op": "masked_fill", "dtype": "float32"}).json()["items"]
    assert {p["composite"] for p in profiles} == {"native", "mutating", "functional", "primitive"}
    assert all(p["median_us"] > 0 for p in profiles if p["valid"])
    assert client.get("/matrix", params={"op": "mask"}).status_code == 404
    response = client.get("/profiles", params={"stack": "vmap,bad"})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("unknown transform 'bad'")
