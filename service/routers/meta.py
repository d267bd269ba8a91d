from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch
from fastapi import APIRouter, HTTPException

from registry.store.db import Store
from service.models import ErrorPublic, Health, VersionPublic

router = APIRouter(tags=["meta"])


@router.get("/healthz", responses={503: {"model": ErrorPublic}})
def healthz() -> Health:
    """Alive, and the store answers a query."""
    try:
        with Store() as store:
            store.entries(op="__healthz__")
    except Exception as error:  # any failure to reach the store is the answer, not a crash
        raise HTTPException(status_code=503,
                            detail=f"the store is unreachable: {type(error).__name__}: {error}") from None
    return Health()


@router.get("/version")
def get_version() -> VersionPublic:
    try:
        ours = version("multicomposite")
    except PackageNotFoundError:
        ours = "unknown"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return VersionPublic(multicomposite=ours, torch=torch.__version__, device=device)
