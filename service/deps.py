"""Shared dependencies: settings, the app-scoped store, the job backend, and the bearer-token check.

Which routes need the token (when MULTICOMPOSITE_TOKEN is set): those that write the store or start work on the
machine, POST /verify, POST /profiles, POST /checks and DELETE /jobs/{id} (``Authorized``). Every read needs none:
the GET routes and POST /select, which is a batch of GET /select queries sent as a POST only because its body is a
list. The scheme is declared in the OpenAPI document (``bearer``), so /docs shows an Authorize button."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from registry.store.db import Store
from service.jobs.backend import JobBackend
from service.settings import Settings
from service.state import StoreState


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_job_backend(request: Request) -> JobBackend:
    """The job backend the app picked at startup, whose jobs live in the store: StoreUnavailableError (503) while
    it cannot be read."""
    request.app.state.store_state.require()
    return request.app.state.runner


def get_state(request: Request) -> StoreState:
    return request.app.state.store_state


def get_store(request: Request) -> Store:
    """The app's store; StoreUnavailableError (503) while it cannot be read."""
    return request.app.state.store_state.require()


# auto_error=False: a missing or malformed header reaches require_token, which answers 401 in this API's words
# (HTTPBearer's own answer is a 403) and only when a token is set at all.
bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="MULTICOMPOSITE_TOKEN, when the server sets it: needed by POST /verify, POST "
                                "/profiles, POST /checks and DELETE /jobs/{id}; reads need none")


def require_token(settings: Annotated[Settings, Depends(get_settings)],
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None) -> None:
    """With MULTICOMPOSITE_TOKEN set, ``Authorization: Bearer <token>`` (compared in constant time)."""
    if settings.token is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if credentials is None or not hmac.compare_digest(given.encode(), settings.token.encode()):
        raise HTTPException(status_code=401, detail="this route needs the header Authorization: Bearer <token>",
                            headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(get_settings)]
JobsDep = Annotated[JobBackend, Depends(get_job_backend)]
StateDep = Annotated[StoreState, Depends(get_state)]
StoreDep = Annotated[Store, Depends(get_store)]
Authorized = Depends(require_token)
