from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

import torch
from fastapi import APIRouter

from registry.store.connection import StoreUnavailableError
from service.deps import StateDep
from service.models import ErrorPublic, Health, VersionPublic

router = APIRouter(tags=["meta"])


# async and without I/O: liveness must answer while the store or the worker is busy.
@router.get("/healthz")
async def healthz() -> Health:
    """The process is alive and serving (no store access: that is /readyz)."""
    return Health()


@router.get("/readyz", responses={503: {"model": ErrorPublic}})
def readyz(state: StateDep) -> Health:
    """The store answers a query now: ready to serve store-backed routes."""
    store = state.require()
    try:
        store.check()
    except StoreUnavailableError:
        state.poll()  # let every route know now, not at the next watch tick
        raise
    return Health()


@cache
def _version() -> VersionPublic:
    try:
        ours = version("multicomposite")
    except PackageNotFoundError:
        ours = "unknown"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return VersionPublic(multicomposite=ours, torch=torch.__version__, device=device)


@router.get("/version")
async def get_version() -> VersionPublic:
    return _version()
