"""One pure ASGI middleware in front of the app: the body limit, cached responses with ETags, and metrics.

- Body limit: a request body is read here, chunk by chunk, and refused with 413 as soon as it passes the limit,
  whether it came with Content-Length or ``Transfer-Encoding: chunked``; the app gets the buffered body.
- Cache: a GET of a read-only route (``/select``, ``/ops``, ``/matrix``, ``/profiles``, ``/version``, ``/healthz``)
  is answered from an LRU of complete 200 responses keyed by (store generation, path, query string); a change of
  generation (someone wrote evidence) makes every entry unreachable. Each such response carries an ETag, and a matching
  ``If-None-Match`` gets 304.
- Methods: ``HEAD`` is answered as the ``GET`` of the same URL without its body (headers, status and length as the
  GET's); ``OPTIONS`` gets 204 with ``Allow``; any other method a path does not take gets 405 with ``Allow`` listing
  every method of that path (the router alone names only the first route that matched the path).
- Content-Type: a POST body must be JSON; any other declared type is 415 saying so, before the body is parsed.
- Metrics: requests and latency per route template.

Pure ASGI rather than ``@app.middleware("http")``: the latter runs every request through an extra task and stream
pair, which costs more than a cached answer itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from registry.core.stacks import shorten
from service.metrics import Metrics
from service.state import CachedResponse, StoreState

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CACHED_PATHS = ("/select", "/ops", "/matrix", "/profiles", "/version", "/healthz")
_BODY_METHODS = (b"POST", b"PUT", b"PATCH", b"DELETE")
_JSON_TYPE = re.compile(rb"^application/([a-z0-9.+-]+\+)?json\s*(;.*)?$", re.IGNORECASE)
# The order every Allow header lists methods in.
_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


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


def _json_response(status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = (),
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"detail": detail}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    return start, {"type": "http.response.body", "body": body}


class ServiceMiddleware:
    def __init__(self, app: ASGIApp, *, state: StoreState, metrics: Metrics, max_body_bytes: int,
                 routes: Sequence[Any] = ()) -> None:
        """``routes``: the app's routes (``app.routes``), read for the methods each path takes; read on each call,
        so routes added after the middleware count too."""
        self.app = app
        self.state = state
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.routes = routes

    def allowed(self, path: str) -> list[str]:
        """Every method some route of ``path`` takes (HEAD wherever GET is, and OPTIONS), in _METHOD_ORDER; empty
        when no endpoint route takes the path (404, or a mount such as /static that answers for itself). Asked of
        each route through Starlette's ``matches`` (FULL: this path and method), the router's own test."""
        from starlette.routing import Match, Mount

        endpoints = [route for route in self.routes if not isinstance(route, Mount)]  # a mount takes any method
        methods = set()
        for method in _METHOD_ORDER:
            probe = {"type": "http", "path": path, "method": method, "root_path": "", "headers": []}
            if any(route.matches(probe)[0] is Match.FULL for route in endpoints):
                methods.add(method)
        if not methods:
            return []
        methods |= {"OPTIONS"} | ({"HEAD"} if "GET" in methods else set())
        return [m for m in _METHOD_ORDER if m in methods]

    async def _refuse(self, send: Send, status: int, detail: str, started: float, method: str,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        start, body = _json_response(status, detail, headers)
        await send(start)
        await send(body)
        self.metrics.observe("unmatched", method, status, time.perf_counter() - started)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method: str = scope["method"]
        if method == "HEAD":  # the GET without its body: the same status, headers and Content-Length
            scope, send = {**scope, "method": "GET"}, _without_body(send)
        elif method == "OPTIONS":
            allowed = self.allowed(scope["path"])
            if allowed:
                await send({"type": "http.response.start", "status": 204,
                            "headers": [(b"allow", ", ".join(allowed).encode())]})
                await send({"type": "http.response.body", "body": b""})
                self.metrics.observe(_route(scope), method, 204, time.perf_counter() - started)
                return
        if method.encode() in _BODY_METHODS:
            declared = _header(scope, b"content-type")
            if declared is not None and not _JSON_TYPE.match(declared):
                given = shorten(declared.decode("latin-1"))
                await self._refuse(send, 415, f"{method} {shorten(scope['path'])} takes a JSON body: send it with "
                                   f"Content-Type: application/json (this request says {given!r})", started, method)
                return
            receive, refused = await self._buffer_body(scope, receive)
            if refused is not None:
                await self._refuse(send, 413, refused, started, method)
                return
        if scope["method"] == "GET" and _cacheable(scope["path"]):
            await self._cached(scope, receive, send, started)
            return
        status = 500
        replaced = False

        async def observing_send(message: Message) -> None:
            nonlocal status, replaced
            if message["type"] == "http.response.start":
                status = message["status"]
                allowed = self.allowed(scope["path"]) if status == 405 else []
                if allowed:  # the router's Allow names one route's methods; the path may have more
                    replaced = True
                    start, body = _json_response(405, f"{method} is not allowed on {shorten(scope['path'])}; it "
                                                 f"takes {', '.join(allowed)}",
                                                 [(b"allow", ", ".join(allowed).encode())])
                    await send(start)
                    await send(body)
                    return
            if not replaced:
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


def _without_body(send: Send) -> Send:
    """``send`` for a HEAD request: the response's start as is (its Content-Length is the GET's), no body bytes."""

    async def head_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head_send


def _route(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", "unmatched")
