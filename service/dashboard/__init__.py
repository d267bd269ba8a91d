"""The dashboard: ``GET /`` serves one static page whose script reads the JSON API (``/matrix``, ``/select``,
``/profiles``, ``/jobs``) like any other client; its CSS, JS and icon come from ``/dashboard/{name}``.

The assets ship inside this package (``static/``): no CDN, no build step, nothing downloaded at run time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

from fastapi import APIRouter, HTTPException, Request, Response

router = APIRouter(include_in_schema=False)

# Every file the page may load, with its media type. Only these names are served, so a request can never reach
# another file of the package (no path joins with user input).
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

# The page runs only its own script and style and talks only to this origin; the browser refuses anything injected.
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


@cache
def load_asset(name: str) -> Asset:
    """The bytes of one shipped asset (read once per process) and a strong ETag over them."""
    body = files(__package__).joinpath("static", name).read_bytes()
    return Asset(body=body, media_type=ASSETS[name], etag='"' + hashlib.sha256(body).hexdigest()[:20] + '"')


def _serve(name: str, request: Request) -> Response:
    asset = load_asset(name)
    # "no-cache" means revalidate: after an upgrade the browser never runs an old script against a new API.
    headers = {**SECURITY_HEADERS, "ETag": asset.etag, "Cache-Control": "no-cache"}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(content=asset.body, media_type=asset.media_type, headers=headers)


@router.get("/")
def dashboard(request: Request) -> Response:
    """The dashboard page."""
    return _serve("index.html", request)


@router.get("/dashboard/{name}")
def dashboard_asset(name: str, request: Request) -> Response:
    """One of the page's assets, by file name."""
    if name not in ASSETS or name == "index.html":
        served = ", ".join(n for n in ASSETS if n != "index.html")
        raise HTTPException(status_code=404, detail=f"no dashboard asset {name[:60]!r}; assets: {served}")
    return _serve(name, request)
