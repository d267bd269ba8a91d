from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch
from fastapi import APIRouter

from service.models import Health, VersionPublic

router = APIRouter(tags=["meta"])


@router.get("/healthz")
def healthz() -> Health:
    return Health()


@router.get("/version")
def get_version() -> VersionPublic:
    try:
        ours = version("multicomposite")
    except PackageNotFoundError:
        ours = "unknown"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return VersionPublic(multicomposite=ours, torch=torch.__version__, device=device)
