"""``create_app(settings)``: the FastAPI app. The store, the store watcher and the job backend live as long as the
app: opened in its lifespan, closed after it."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import SQLAlchemyError

import registry
from registry.core.stacks import shorten
from registry.store.connection import StoreUnavailableError
from service import dashboard
from service.jobs.startup import job_backend
from service.metrics import Metrics
from service.middleware import ServiceMiddleware
from service.models import ErrorPublic
from service.routers import checks, jobs, meta, ops, select, store
from service.settings import Settings
from service.state import StoreState
from service.validation import InputError


def docs_assets() -> Path:
    """Swagger UI and ReDoc, as shipped by the fastapi-offline package: served from /static, never a CDN."""
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def _store_unavailable(error: Exception) -> JSONResponse:
    if isinstance(error, StoreUnavailableError):
        reason = str(error)
    else:
        reason = f"the store cannot be read: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    return JSONResponse(status_code=503, content={
        "detail": f"{reason}; check MULTICOMPOSITE_DB and the file, then retry (GET /readyz says when it is back)"},
        headers={"Retry-After": "5"})


def _validation_part(error: dict[str, Any]) -> str:
    """One error of a request's validation: where, then what is wrong (a body that is not JSON says where it
    breaks, not a path into it)."""
    if error["type"] == "json_invalid":
        position = error["loc"][-1] if len(error["loc"]) > 1 else "?"
        cause = shorten(str(error.get("ctx", {}).get("error", "")), 80)
        return f"body: not valid JSON at character {position}: {cause}; send a JSON document"
    if error["type"] == "list_type" and tuple(error["loc"]) == ("body",):  # POST /select, the one list body
        return ("body: POST /select takes a JSON list of queries, [{\"op\": \"index_fill\", \"stack\": "
                "\"vmap(grad)\"}, ...]; GET /select answers one query")
    where = ".".join(shorten(part, 24) for part in error["loc"])
    return f"{where}: {shorten(error['msg'].removeprefix('Value error, '), 200)}"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    registry.load()
    state = StoreState(settings.db, settings.evidence_poll_s, settings.cache_size, settings.cache_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.open()  # StoreUnavailableError: the server does not start
        runner = job_backend(settings, state)  # once: the routers call it through the JobBackend protocol
        app.state.runner = runner
        app.state.metrics.runner = runner
        runner.start()
        try:
            yield
        finally:
            runner.shutdown()
            state.close()

    app = FastAPI(title="multicomposite", description="Which decomposition of a PyTorch op fits a transform stack",
                  responses={code: {"model": ErrorPublic} for code in (401, 404, 405, 409, 413, 415, 422, 429, 503)},
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.store_state = state
    app.state.metrics = metrics = Metrics()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        # One readable string, like every other error of this API: where, and what is wrong; never the input itself
        # beyond a short prefix.
        parts = [_validation_part(e) for e in error.errors()]
        return JSONResponse(status_code=422, content={"detail": "; ".join(parts[:5])})

    @app.exception_handler(InputError)
    async def input_error(_request: Request, error: InputError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(error)})

    async def store_error(_request: Request, error: Exception) -> JSONResponse:
        return _store_unavailable(error)

    for kind in (StoreUnavailableError, SQLAlchemyError, sqlite3.Error):
        app.add_exception_handler(kind, store_error)

    static = docs_assets()
    app.mount("/static", StaticFiles(directory=static), name="static")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="multicomposite API",
                                   swagger_js_url="/static/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger-ui.css", swagger_favicon_url="/static/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="multicomposite API",
                              redoc_js_url="/static/redoc.standalone.js", redoc_favicon_url="/static/favicon.png",
                              with_google_fonts=False)

    for module in (meta, ops, select, store, jobs, checks, dashboard):
        app.include_router(module.router)
    app.get("/metrics", include_in_schema=False)(metrics.endpoint)
    app.add_middleware(ServiceMiddleware, state=state, metrics=metrics, max_body_bytes=settings.max_body_bytes,
                       routes=app.routes)
    return app
