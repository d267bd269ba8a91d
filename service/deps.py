"""Shared dependencies: settings, the app-scoped store, the job runner, and the bearer-token check for POST and
DELETE."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from registry.store.db import Store
from service.jobs import JobRunner
from service.settings import Settings
from service.state import StoreState
from service.worker import QueuedJobs


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_runner(request: Request) -> JobRunner | QueuedJobs:
    """The job runner, whose jobs live in the store: StoreUnavailableError (503) while it cannot be read."""
    request.app.state.store_state.require()
    return request.app.state.runner


def get_state(request: Request) -> StoreState:
    return request.app.state.store_state


def get_store(request: Request) -> Store:
    """The app's store; StoreUnavailableError (503) while it cannot be read."""
    return request.app.state.store_state.require()


def require_token(settings: Annotated[Settings, Depends(get_settings)],
                  authorization: Annotated[str | None, Header()] = None) -> None:
    """With MULTICOMPOSITE_TOKEN set, ``Authorization: Bearer <token>`` (compared in constant time)."""
    if settings.token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), settings.token.encode()):
        raise HTTPException(status_code=401, detail="this route needs the header Authorization: Bearer <token>",
                            headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(get_settings)]
RunnerDep = Annotated[JobRunner | QueuedJobs, Depends(get_runner)]
StateDep = Annotated[StoreState, Depends(get_state)]
StoreDep = Annotated[Store, Depends(get_store)]
Authorized = Depends(require_token)
