from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.cli import main
from service.main import create_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app())


def test_healthz_and_version(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/version").json()["torch"].startswith("2.")


def test_ops(client: TestClient) -> None:
    ops = {op["name"]: op for op in client.get("/ops").json()}
    assert set(ops) == {"index_add", "index_copy", "index_fill", "masked_fill", "masked_scatter", "contiguous", "to"}
    assert [c["kind"] for c in ops["index_fill"]["composites"]] == ["native", "mutating", "functional", "primitive"]
    detail = client.get("/ops/masked_scatter").json()
    assert "torch.Tensor.masked_scatter" in detail["entry_points"]
    assert "class" not in detail["composites"][2]["source"] and "def masked_scatter_functional" in \
        detail["composites"][2]["source"]


def test_select(client: TestClient) -> None:
    body = client.get("/select", params={"op": "index_fill", "stack": "vmap,grad"}).json()
    assert (body["composite"], body["kind"]) == ("functional", "functional")
    assert body["stack"] == ["vmap", "grad"]
    assert {a["composite"]: a["ok"] for a in body["alternatives"]} == {
        "native": False, "mutating": False, "primitive": True}


def test_errors_say_what_to_fix(client: TestClient) -> None:
    response = client.get("/ops/index_fil")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("unknown op 'index_fil'; did you mean index_fill")
    response = client.get("/select", params={"op": "index_fill", "stack": "vmap,gard"})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "select(index_fill): unknown transform 'gard' in stack 'vmap,gard'; valid: vmap, grad, jvp, functionalize, "
        "autograd, compile, jacrev, jacfwd, hessian"
    )
    response = client.get("/select", params={"op": "index_fill", "stack": "vmap", "pin": "mutating"})
    assert response.status_code == 422
    assert response.json()["detail"].endswith("valid choices: functional, primitive")


def test_cli_select(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "masked_scatter", "--stack", "vmap"]) == 0
    assert '"composite": "functional"' in capsys.readouterr().out
    assert main(["select", "nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err


def test_matrix_and_profiles_read_the_store(client: TestClient) -> None:
    import torch

    from registry.harness.verify import verify
    from registry.profiling.timing import profile
    from registry.store.db import Store

    with Store() as store:
        store.write_entries(verify(ops=["masked_fill"], stacks=["vmap"], dtypes=(torch.float32,),
                                   composites=["native", "functional"]))
        # What the API reads back, not the noise control: a 10 ms run on a loaded machine is always disturbed.
        store.write_profiles(profile(ops=["masked_fill"], workloads=["vmap"], batch_sizes=(4,), numels=(64,),
                                     min_run_time=0.01, spread_limit=float("inf")))
    functional = client.get("/ops/masked_fill").json()["composites"][2]
    assert functional["name"] == "functional" and "vmap" in functional["verified"]
    matrix = client.get("/matrix", params={"op": "masked_fill", "stack": "vmap"}).json()
    assert {(e["composite"], e["pattern"]) for e in matrix} >= {("functional", "all"), ("native", "others")}
    assert all(e["status"] == "ok" for e in matrix if e["composite"] == "functional")
    profiles = client.get("/profiles", params={"op": "masked_fill", "dtype": "float32"}).json()
    assert {p["composite"] for p in profiles} == {"native", "mutating", "functional", "primitive"}
    assert all(p["median_us"] > 0 for p in profiles if p["valid"])
    assert client.get("/matrix", params={"op": "mask"}).status_code == 404
    response = client.get("/profiles", params={"stack": "vmap,bad"})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("unknown transform 'bad'")
    from registry.store import evidence

    evidence.use_loader(None)
    evidence.use_profile_loader(None)
