"""``create_app()``: the FastAPI app."""

from __future__ import annotations

from fastapi import FastAPI

import registry
from service.routers import meta, ops, select, store


def create_app() -> FastAPI:
    registry.load()
    app = FastAPI(title="multicomposite", description="Which decomposition of a PyTorch op fits a transform stack")
    for module in (meta, ops, select, store):
        app.include_router(module.router)
    return app
