from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

import registry
from registry.core import kernels
from service.cli import main

# Each test that uses a store runs on SQLite and on PostgreSQL (tests/service/conftest.py).
STORE_BACKENDS = ("sqlite", "postgres")
# The cpp_op composites are valid where the C++ ops are built (make test builds them; without a compiler they are not).
CPP_OPS = kernels.fused_ops_available()


@pytest.fixture
def client(serve) -> TestClient:
    return serve()


def test_healthz_readyz_and_version(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}
    assert client.get("/version").json()["torch"].startswith("2.")


def test_ops(client: TestClient) -> None:
    ops = {op["name"]: op for op in client.get("/ops").json()}
    assert list(ops) == list(registry.OPS)  # every covered op, the seed ops among them
    assert {"index_add", "index_copy", "index_fill", "masked_fill", "masked_scatter", "contiguous", "to",
            "take"} <= set(ops)
    assert [c["kind"] for c in ops["take"]["composites"]] == ["native", "functional"]
    assert [c["kind"] for c in ops["index_fill"]["composites"]] == ["native", "mutating", "functional", "primitive",
                                                                    "cpp_op"]
    detail = client.get("/ops/masked_scatter").json()
    assert "torch.Tensor.masked_scatter" in detail["entry_points"]
    assert "class" not in detail["composites"][2]["source"] and "def masked_scatter_functional" in \
        detail["composites"][2]["source"]


def test_ops_show_package_relative_paths(client: TestClient) -> None:
    # Defect 11: absolute install paths (/home/..., site-packages) were shown.
    wheres = [c["where"] for c in client.get("/ops/masked_scatter").json()["composites"]]
    # The generated native composite is "where" its define_op entry is.
    assert all(re.fullmatch(r"composites/(masked|cpp_ops)\.py:\d+", where) for where in wheres), wheres


def test_select(client: TestClient) -> None:
    body = client.get("/select", params={"op": "index_fill", "stack": "vmap,grad"}).json()
    # The shipped reference profiles rank the C++ op first where it is built; the rules pick functional otherwise.
    chosen = "cpp_op" if CPP_OPS else "functional"
    assert (body["composite"], body["kind"]) == (chosen, chosen)
    assert body["stack"] == "vmap(grad)"
    assert (body["speedup"], body["runner_up_speedup"]) == (None, None)
    others = {"native": False, "mutating": False, "primitive": True, "functional": True, "cpp_op": CPP_OPS}
    assert {a["composite"]: a["ok"] for a in body["alternatives"]} == {
        name: ok for name, ok in others.items() if name != chosen}


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
    assert response.json()["detail"].endswith("valid choices: functional, primitive" + (", cpp_op" if CPP_OPS else ""))


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
    assert main(["select", "masked_scatter", "--stack", "vmap(grad)", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"composite": "functional"' in out and '"stack": "vmap(grad)"' in out
    assert main(["select", "nope"]) == 2
    assert capsys.readouterr().err.startswith("multicomposite select: argument op: unknown op 'nope'")


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
    assert {p["composite"] for p in profiles} == {"native", "mutating", "functional", "primitive", "cpp_op"}
    assert all(p["median_us"] > 0 for p in profiles if p["valid"])
    assert client.get("/matrix", params={"op": "mask"}).status_code == 404
    response = client.get("/profiles", params={"stack": "vmap,bad"})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("unknown transform 'bad'")


# --- issue 20, part 3: requests ---------------------------------------------------------------------------------------


def test_unknown_body_fields_are_refused_naming_the_field(client: TestClient) -> None:
    # {"opz": [...]} on POST /verify started a job over every op; batch_sizes misspelled was ignored.
    cases = [
        ("/verify", {"opz": ["index_fill"]}, "body: unknown field 'opz'; the fields are ops, stacks, dtypes"),
        ("/profiles", {"ops": ["index_fill"], "batch_size": [4]},
         "body: unknown field 'batch_size'; the fields are ops, workloads, batch_sizes, numels, dtypes, device, "
         "device_kind, min_run_time"),
        ("/select", [{"op": "index_fill"}, {"op": "index_fill", "stak": "vmap"}],
         "body.1: unknown field 'stak'; the fields are op, stack, batched, dtype, device, numel, policy, pin, "
         "shapes, batch_size, native_batch_rules"),
    ]
    for path, body, detail in cases:
        response = client.post(path, json=body)
        assert (response.status_code, response.json()) == (422, {"detail": detail}), path
    assert client.get("/metrics").text.count('multicomposite_jobs{state="queued"} 0.0') == 1  # no job started


def test_an_empty_list_is_refused_and_omitting_it_means_every(client: TestClient) -> None:
    for path, field, every in (("/verify", "ops", "every covered op"), ("/verify", "stacks",
                                                                         "every stack of the matrix"),
                               ("/profiles", "workloads", "every workload"), ("/profiles", "dtypes", "float32")):
        response = client.post(path, json={field: []})
        assert (response.status_code, response.json()["detail"]) == (
            422, f"body.{field}: an empty list names nothing to run; leave {field} out (or null) for {every}"), field


def test_head_and_options_answer_with_allow(client: TestClient) -> None:
    get = client.get("/select", params={"op": "index_fill"})
    head = client.head("/select", params={"op": "index_fill"})
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == get.headers["content-length"] and head.headers["etag"] == \
        get.headers["etag"]
    assert client.head("/healthz").status_code == 200
    assert client.head("/jobs/nope").status_code == 404  # the GET's answer, without its body
    for path, allow in (("/select", "GET, HEAD, POST, OPTIONS"), ("/verify", "POST, OPTIONS"),
                        ("/jobs/abc", "GET, HEAD, DELETE, OPTIONS"), ("/ops/index_fill", "GET, HEAD, OPTIONS")):
        options = client.options(path)
        assert (options.status_code, options.headers["allow"], options.content) == (204, allow, b""), path
    # Any other method: 405 with every method of the path (the router named only its first route's: POST).
    response = client.put("/select")
    assert (response.status_code, response.headers["allow"], response.json()) == (
        405, "GET, HEAD, POST, OPTIONS", {"detail": "PUT is not allowed on /select; it takes GET, HEAD, POST, "
                                                    "OPTIONS"})
    response = client.delete("/profiles")
    assert (response.status_code, response.headers["allow"]) == (405, "GET, HEAD, POST, OPTIONS")


def test_a_body_that_is_not_json_is_415(client: TestClient) -> None:
    # Was "body: Input should be a valid list" for a JSON text sent as text/plain (curl -d sends a form type).
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        response = client.post("/select", content=b'[{"op": "index_fill"}]', headers={"Content-Type": content_type})
        assert (response.status_code, response.json()) == (415, {
            "detail": "POST /select takes a JSON body: send it with Content-Type: application/json (this request "
                      f"says {content_type!r})"})
    for content_type in ("application/json", "application/json; charset=utf-8"):
        response = client.post("/select", content=b'[{"op": "index_fill"}]', headers={"Content-Type": content_type})
        assert response.status_code == 200, content_type


def test_one_query_posted_as_an_object_says_that_post_select_takes_a_list(client: TestClient) -> None:
    # Was "body: Input should be a valid list": the GET form's one query sent as POST's body.
    response = client.post("/select", json={"op": "index_fill", "stack": "vmap"})
    assert (response.status_code, response.json()) == (422, {
        "detail": 'body: POST /select takes a JSON list of queries, [{"op": "index_fill", "stack": "vmap(grad)"}, '
                  '...]; GET /select answers one query'})
    assert client.post("/select", json=[{"op": "index_fill", "stack": "vmap"}]).status_code == 200


def test_metrics_report_a_failing_store_instead_of_failing(client: TestClient) -> None:
    from registry.store.connection import StoreUnavailableError

    assert "multicomposite_store_up 1.0" in client.get("/metrics").text

    def down() -> dict[str, int]:
        raise StoreUnavailableError("the store at sqlite:///x cannot be read")

    client.app.state.runner.states = down  # job counts are read from the store
    response = client.get("/metrics")
    assert response.status_code == 200  # was 503: the scrape failed with the store
    assert "multicomposite_store_up 0.0" in response.text
    assert 'multicomposite_requests_total{method="GET",route="/metrics",status="200"}' in response.text


def test_reads_need_no_token_and_writes_do(serve) -> None:
    client = serve(token="s3cret")
    assert client.post("/select", json=[{"op": "index_fill"}]).status_code == 200  # a read, sent as a POST
    assert client.get("/select", params={"op": "index_fill"}).status_code == 200
    for method, path, body in (("POST", "/verify", {}), ("POST", "/profiles", {}), ("DELETE", "/jobs/abc", None)):
        response = client.request(method, path, json=body)
        assert (response.status_code, response.headers["www-authenticate"]) == (401, "Bearer"), path
        response = client.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401, path
        response = client.request(method, path, json=body, headers={"Authorization": "bearer s3cret"})
        assert response.status_code not in (401, 403), path


def test_openapi_declares_the_bearer_scheme_and_describes_every_parameter(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["type"] == "http"
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"  # /docs: an Authorize button
    secured = {(path, method) for path, operations in schema["paths"].items()
               for method, operation in operations.items() if operation.get("security")}
    assert secured == {("/verify", "post"), ("/profiles", "post"), ("/checks", "post"), ("/jobs/{job_id}", "delete")}
    undescribed = [f"{method.upper()} {path} {parameter['name']}" for path, operations in schema["paths"].items()
                   for method, operation in operations.items() for parameter in operation.get("parameters", [])
                   if not parameter.get("description")]
    assert undescribed == []
    for name in ("VerifyCreate", "ProfileCreate", "SelectQuery", "JobPublic", "CheckCreate", "CheckPublic",
                 "CheckSummary"):
        model = schema["components"]["schemas"][name]
        assert [field for field, spec in model["properties"].items() if not spec.get("description")] == [], name
    for name in ("VerifyCreate", "ProfileCreate", "SelectQuery", "CheckCreate"):
        assert schema["components"]["schemas"][name]["additionalProperties"] is False, name


# --- issue 20, part 4: outputs ----------------------------------------------------------------------------------------

ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def test_jobs_spell_stacks_one_way_and_give_iso_times(client: TestClient, db_url: str) -> None:
    import time

    from registry.store.db import Store
    from registry.store.records import JobRecord

    client.app.state.runner._run = lambda job, progress: (progress(1, 1), {"entries": 0})[1]
    response = client.post("/verify", json={"ops": ["masked_fill"], "stacks": ["vmap,grad", "vmap(jvp)"]})
    assert response.status_code == 202
    job = response.json()
    assert job["params"]["stacks"] == ["vmap(grad)", "vmap(jvp)"]  # was [["vmap", "grad"], ["vmap", "jvp"]]
    assert ISO_UTC.fullmatch(job["created_at"]), job["created_at"]  # was an epoch float
    for _ in range(200):
        job = client.get(f"/jobs/{job['id']}").json()
        if job["state"] == "done":
            break
        time.sleep(0.05)
    assert job["state"] == "done" and ISO_UTC.fullmatch(job["started_at"]) and ISO_UTC.fullmatch(job["finished_at"])
    with Store(db_url) as store:  # a job stored before: its stacks as lists of names
        store.add_job(JobRecord(id="old", kind="verify", params={"ops": ["take"], "stacks": [["vmap", "grad"]]},
                                state="done", created_at=0.25, started_at=None, finished_at=None))
    old = client.get("/jobs/old").json()
    assert (old["params"]["stacks"], old["created_at"], old["started_at"]) == (
        ["vmap(grad)"], "1970-01-01T00:00:00.250Z", None)


def test_matrix_entries_give_iso_times(client: TestClient, db_url: str) -> None:
    import time

    import torch

    from registry.core.sources import source_hashes
    from registry.store.db import Store
    from registry.store.records import MatrixEntry

    entry = MatrixEntry(op="take", composite="functional", kind="functional", stack=("vmap",), pattern="all",
                        dtype="float32", status="ok", detail="", max_abs_error=0.0, max_rel_error=0.0,
                        source_hash=source_hashes()[("take", "functional")], torch_version=torch.__version__,
                        device="cpu", measured_at=1764522309.5)
    with Store(db_url) as store:
        store.write_entries([entry])
    time.sleep(0.3)  # the watcher sees the new generation
    items = client.get("/matrix", params={"op": "take"}).json()["items"]
    assert [item["measured_at"] for item in items] == ["2025-11-30T17:05:09.500Z"]


def test_a_body_that_is_not_valid_json_says_where(client: TestClient) -> None:
    response = client.post("/select", content=b'[{"op":', headers={"Content-Type": "application/json"})
    assert (response.status_code, response.json()) == (422, {  # was "body.7: JSON decode error"
        "detail": "body: not valid JSON at character 7: Expecting value; send a JSON document"})


SDPA_SHAPES = {"query": [1, 2, 16, 16], "key": [1, 2, 16, 16], "value": [1, 2, 16, 16]}


def test_select_at_the_call_sizes(client: TestClient) -> None:
    """POST and GET /select with per-sample shapes and a batch size answer the choice by cost at those sizes (the
    shipped reference costs), the same as registry.select; the reason names the bucket."""
    query = {"op": "scaled_dot_product_attention", "stack": "vmap(grad)", "batched": ["query", "key", "value"],
             "shapes": SDPA_SHAPES, "batch_size": 4}
    posted = client.post("/select", json=[query]).json()[0]
    expected = registry.select("scaled_dot_product_attention", stack="vmap(grad)", batched=["query", "key", "value"],
                               shapes=SDPA_SHAPES, batch_size=4)
    assert (posted["composite"], posted["reason"]) == (expected.composite, expected.reason)
    assert "at batch 4, heads 2, length 16, head_dim 16, no mask, rank 4" in posted["reason"]
    got = client.get("/select", params={"op": "scaled_dot_product_attention", "stack": "vmap(grad)",
                                        "batched": "query,key,value", "batch_size": 4,
                                        "shapes": "query:1x2x16x16,key:1x2x16x16,value:1x2x16x16"}).json()
    assert (got["composite"], got["reason"]) == (expected.composite, expected.reason)


@pytest.mark.parametrize(("shapes", "detail"), [
    ("query:1x2x16x16,key", "shapes entry 'key' is not name:AxBxC, e.g. query:1x2x16x16"),
    ("query:1xtwo", "shapes entry 'query:1xtwo' is not name:AxBxC, e.g. query:1x2x16x16"),
    ("query:1x2x16x16,mask:1", "shapes names mask, which are not tensor arguments given here"),
])
def test_select_shapes_it_cannot_read_are_a_4xx(client: TestClient, shapes: str, detail: str) -> None:
    response = client.get("/select", params={"op": "scaled_dot_product_attention", "stack": "vmap",
                                             "batched": "query", "shapes": shapes})
    assert 400 <= response.status_code < 500
    assert detail in response.json()["detail"]


def test_cli_select_at_the_call_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    shapes = "query:1x2x16x16,key:1x2x16x16,value:1x2x16x16"
    assert main(["select", "scaled_dot_product_attention", "--stack", "vmap(grad)", "--batched", "query,key,value",
                 "--shapes", shapes, "--batch-size", "4"]) == 0
    expected = registry.select("scaled_dot_product_attention", stack="vmap(grad)", batched=["query", "key", "value"],
                               shapes=SDPA_SHAPES, batch_size=4)
    assert f"reason: {expected.reason}" in capsys.readouterr().out.splitlines()
    assert main(["select", "scaled_dot_product_attention", "--stack", "vmap", "--shapes", "query:1xtwo"]) == 2
    assert capsys.readouterr().err == ("multicomposite select: shapes entry 'query:1xtwo' is not name:AxBxC, e.g. "
                                       "query:1x2x16x16\n")
