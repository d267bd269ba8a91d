"""Bounded state and strict inputs (defects 2, 3, 8): closed sets for dtype and device, stack depth within the
matrix's, an LRU on every cache, a body limit that also covers chunked bodies, short error echoes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import registry
from registry.core import selector

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(serve) -> TestClient:
    return serve(max_body_bytes=4096)


def _detail(response: httpx.Response) -> str:
    assert response.status_code == 422, response.text
    return response.json()["detail"]


def test_values_outside_their_closed_sets_are_422(client: TestClient) -> None:
    def select(**params: str) -> str:
        return _detail(client.get("/select", params={"op": "index_fill", **params}))

    assert select(dtype="float33") == ("unknown dtype 'float33'; use a torch dtype name such as float32, float64, "
                                       "float16, bfloat16, int64, int32, bool, complex64")
    assert select(device="tpu:99") == ("device 'tpu:99' is not available here; devices: cpu (a type, optionally with "
                                       "an index: cuda:0)")
    if not torch.cuda.is_available():
        assert select(device="cuda").startswith("device 'cuda' is not available here; devices: cpu")
    assert select(stack="grad", dtype="int8") == ("dtype int8 has no derivative under grad: grad needs a floating "
                                                  "point or complex dtype")
    assert select(stack="vmap,vmap,vmap,grad") == ("stack 'vmap(vmap(vmap(grad)))' is 4 transforms deep; the "
                                                   "verified matrix covers at most 3")
    assert select(stack="vmap," * 500) == "query.stack: String should have at most 120 characters"
    assert select(policy="fast") == "unknown policy 'fast'; policies are auto, fastest, rules, native"
    assert select(stack="vmap", batched="x" * 100) == (
        "batched name '" + "x" * 39 + "…' is not a tensor argument of index_fill; its tensor arguments are self, "
        "index, value")


def test_error_bodies_echo_a_short_prefix_only(client: TestClient) -> None:
    long_op = "o" * 60
    detail = client.get("/ops/" + long_op).json()["detail"]
    assert "o" * 41 not in detail and detail.startswith("unknown op '" + "o" * 39 + "…'")
    response = client.post("/select", json=[{"op": "index_fill", "device": "d" * 30}])
    assert _detail(response).startswith("query 0: device 'dddddddddddddddddddddddddddddd' is not available")
    response = client.post("/select", json=[{"op": "index_fill", "dtype": "z" * 2000}])
    assert _detail(response) == "body.0.dtype: String should have at most 32 characters"


def test_distinct_devices_are_refused_and_never_cached(serve) -> None:
    # Defect 2: 20,000 queries with distinct device strings grew RSS by 60-190 MB, never freed.
    client = serve()
    selector.clear_cache()
    response = client.post("/select", json=[{"op": "index_add", "device": f"dev{i}"} for i in range(200)])
    assert _detail(response).startswith("query 0: device 'dev0' is not available here")
    assert len(selector.SELECTOR.cache) == 0


def test_every_cache_is_bounded(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selector.SELECTOR, "capacity", 8)
    selector.clear_cache()
    for numel in range(20):  # 20 distinct power-of-two sizes: 20 decision keys
        registry.select("index_add", stack="vmap", numel=2**numel)
    assert len(selector.SELECTOR.cache) == 8
    client = serve(cache_size=4)
    for numel in range(10):
        assert client.get("/select", params={"op": "index_add", "numel": numel}).status_code == 200
    assert len(client.app.state.store_state.responses) == 4
    by_bytes = serve(cache_size=1000, cache_bytes=1 << 16)  # 64 KiB: about 110 decisions of ~600 bytes
    for numel in range(200):
        assert by_bytes.get("/select", params={"op": "index_add", "numel": numel}).status_code == 200
    responses = by_bytes.app.state.store_state.responses
    assert responses.bytes <= 1 << 16 and 50 < len(responses) < 200


def test_chunked_body_over_the_limit_is_413(client: TestClient) -> None:
    # Defect 3: a chunked body (no Content-Length) skipped the limit and was read whole.
    def chunks():
        yield b"["
        for _ in range(100):
            yield b" " * 100
        yield b"]"

    response = client.post("/select", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"detail": "request body of more than 4096 bytes is over the limit of 4096"}


def test_chunked_body_over_the_limit_on_a_real_server(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": f"sqlite:///{tmp_path / 's.db'}",
           "MULTICOMPOSITE_MAX_BODY_BYTES": "65536"}
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.3)
        def rss_mb() -> float:
            status = Path(f"/proc/{server.pid}/status").read_text()
            return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024

        before = rss_mb()

        def body():  # 100 MB, chunked (httpx sends it all before reading the answer; the server never keeps it)
            yield b"["
            for _ in range(100 * 1024):
                yield b" " * 1024

        try:
            response = httpx.post(f"http://127.0.0.1:{port}/select", content=body(), timeout=30,
                                  headers={"Content-Type": "application/json"})
            assert response.status_code == 413
            assert response.json() == {"detail": "request body of more than 65536 bytes is over the limit of 65536"}
        except (httpx.WriteError, httpx.RemoteProtocolError):
            pass  # the server answered 413 and closed while the client still wrote: also refused
        assert rss_mb() - before < 20  # was +107 MB
    finally:
        server.terminate()
        server.wait(20)


def test_a_bad_dtype_never_imports_the_compiler() -> None:
    # Defect 8: dtype=_inductor ran getattr(torch, "_inductor"): a 1 s import of torch._inductor in the event loop.
    script = textwrap.dedent("""
        import sys, tempfile
        from fastapi.testclient import TestClient
        from service.main import create_app
        from service.settings import Settings
        with TestClient(create_app(Settings(db=f"sqlite:///{tempfile.mkdtemp()}/s.db"))) as client:
            response = client.get("/select", params={"op": "index_fill", "dtype": "_inductor"})
        print(response.status_code, "torch._inductor" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout.split() == ["422", "False"], result.stderr[-2000:]


def _longest_echo(text: str) -> int:
    return max((len(run) for run in re.findall("Q+", text)), default=0)


def test_no_error_echoes_more_than_40_characters_of_input(client: TestClient) -> None:
    # Issue 20: a bad stack was echoed with 59 characters (the README promises at most 40), a pin with 64.
    long = "Q" * 1000
    requests: list[tuple[str, str, dict]] = []
    for name, size in (("op", 64), ("stack", 120), ("batched", 200), ("dtype", 32), ("device", 32), ("policy", 16),
                       ("pin", 40)):
        query = {"op": "index_fill", name: long[:size]}
        requests += [("GET", "/select", {"params": query}), ("POST", "/select", {"json": [query]})]
    for path in ("/matrix", "/profiles"):
        for name, size in (("op", 64), ("composite", 64), ("status", 16), ("stack", 120), ("cursor", 1000),
                           ("dtype", 32), ("device", 32)):
            requests.append(("GET", path, {"params": {name: long[:size]}}))
    requests += [("GET", "/ops/" + long[:64], {}), ("GET", "/jobs/" + long[:200], {}), ("GET", "/" + long[:200], {}),
                 ("POST", "/verify", {"json": {"stacks": [long[:120]]}}),
                 ("POST", "/verify", {"json": {"ops": [long[:64]]}}),
                 ("POST", "/verify", {"json": {long[:100]: 1}}),
                 ("POST", "/profiles", {"json": {"workloads": [long[:32]]}}),
                 ("POST", "/profiles", {"json": {"device": long[:16]}}),
                 ("POST", "/profiles", {"json": {"device_kind": long[:120]}}),
                 ("POST", "/select", {"content": b"[" + long.encode(),
                                      "headers": {"Content-Type": "application/json"}}),
                 ("POST", "/select", {"content": b"[]", "headers": {"Content-Type": long[:500]}})]
    echoes = {}
    for method, path, arguments in requests:
        response = client.request(method, path, **arguments)
        assert response.status_code < 500, (method, path, response.text)
        echoes[f"{method} {path[:20]} {sorted(arguments.get('params', {}))}"] = _longest_echo(response.text)
    assert {where: n for where, n in echoes.items() if n > 40} == {}
    assert max(echoes.values()) == 40  # 39 characters and an ellipsis: the sweep reached the limit
