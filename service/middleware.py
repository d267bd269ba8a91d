"""One pure ASGI middleware in front of the app: the body limit, cached responses with ETags, and metrics.

- Body limit: a request body is read here, chunk by chunk, and refused with 413 as soon as it passes the limit,
  whether it came with Content-Length or ``Transfer-Encoding: chunked``; the app gets the buffered body.
- Cache: a GET of a read-only route (``/select``, ``/ops``, ``/matrix``, ``/profiles``, ``/version``, ``/healthz``)
  is answered from an LRU of complete 200 responses keyed by (store generation, path, query string); a change of
  generation (someone wrote evidence) makes every entry unreachable. Each such response carries an ETag, and a matching
  ``If-None-Match`` gets 304.
- Metrics: requests and latency per route template.

Pure ASGI rather than ``@app.middleware("http")``: the latter runs every request through an extra task and stream
pair, which costs more than a cached answer itself.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from service.metrics import Metrics
from service.state import CachedResponse, StoreState

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CACHED_PATHS = ("/select", "/ops", "/matrix", "/profiles", "/version", "/healthz")
_BODY_METHODS = (b"POST", b"PUT", b"PATCH", b"DELETE")


def _cacheable(path: str) -> bool:
    return path in CACHED_PATHS or path.startswith("/ops/")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _matches(if_none_match: bytes | None, etag: bytes) -> bool:
    if if_none_match is None:
        return False
    tags = [tag.strip().removeprefix(b"W/") for tag in if_none_match.split(b",")]
    return etag in tags or b"*" in tags


def _json_response(status: int, detail: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"detail": detail}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, {"type": "http.response.body", "body": body}


class ServiceMiddleware:
    def __init__(self, app: ASGIApp, *, state: StoreState, metrics: Metrics, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method: str = scope["method"]
        if method.encode() in _BODY_METHODS:
            receive, refused = await self._buffer_body(scope, receive)
            if refused is not None:
                start, body = _json_response(413, refused)
                await send(start)
                await send(body)
                self.metrics.observe("unmatched", method, 413, time.perf_counter() - started)
                return
        if method == "GET" and _cacheable(scope["path"]):
            await self._cached(scope, receive, send, started)
            return
        status = 500

        async def observing_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            self.metrics.observe(_route(scope), method, status, time.perf_counter() - started)

    async def _buffer_body(self, scope: Scope, receive: Receive) -> tuple[Receive, str | None]:
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return receive, f"request body of {int(declared)} bytes is over the limit of {limit}"
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                chunks_done: list[Message] = [message]
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return receive, f"request body of more than {limit} bytes is over the limit of {limit}"
            chunks.append(chunk)
            if not message.get("more_body", False):
                chunks_done = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break
        replay = iter(chunks_done)

        async def buffered_receive() -> Message:
            try:
                return next(replay)
            except StopIteration:
                return await receive()  # after the body: wait for a disconnect, as the server would say

        return buffered_receive, None

    async def _cached(self, scope: Scope, receive: Receive, send: Send, started: float) -> None:
        state = self.state
        key = (state.generation, scope["path"], scope["query_string"])
        hit = state.responses.get(key) if state.error is None else None
        if hit is None:
            captured: dict[str, Any] = {"body": []}

            async def capture(message: Message) -> None:
                if message["type"] == "http.response.start":
                    captured["start"] = message
                elif message["type"] == "http.response.body":
                    captured["body"].append(message.get("body", b""))

            await self.app(scope, receive, capture)
            start = captured["start"]
            body = b"".join(captured["body"])
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            etag = None
            if start["status"] == 200:
                etag = b'"' + hashlib.blake2b(body, digest_size=12).hexdigest().encode() + b'"'
                headers.append((b"etag", etag))
            hit = CachedResponse(status=start["status"], headers=headers, body=body, etag=etag, route=_route(scope))
            if start["status"] == 200 and key[0] == state.generation and state.error is None:
                state.responses.put(key, hit)
        if hit.etag is not None and _matches(_header(scope, b"if-none-match"), hit.etag):
            await send({"type": "http.response.start", "status": 304, "headers": [(b"etag", hit.etag)]})
            await send({"type": "http.response.body", "body": b""})
            status = 304
        else:
            await send({"type": "http.response.start", "status": hit.status, "headers": hit.headers})
            await send({"type": "http.response.body", "body": hit.body})
            status = hit.status
        self.metrics.observe(hit.route, "GET", status, time.perf_counter() - started)


def _route(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", "unmatched")
