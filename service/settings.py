"""Settings from the environment (``MULTICOMPOSITE_`` prefix) or the command line, checked before the server starts:
an empty token, a value of the wrong type or an unknown ``MULTICOMPOSITE_*`` name is refused with one line."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.limits import MAX_BATCH, MAX_CONTEXTS, MAX_NUMEL, PORTS

PREFIX = "MULTICOMPOSITE_"
# The library's own variables, read by registry and composites in any process (the server's included), so known here
# too; copies, since importing their modules imports torch. tests/service/test_settings.py checks them against every
# MULTICOMPOSITE_ name the sources read.
LIBRARY_VARIABLES: frozenset[str] = frozenset({
    "MULTICOMPOSITE_ROUTING",  # docs/routing.md
    "MULTICOMPOSITE_KERNELS_DIR",
    "MULTICOMPOSITE_KERNEL_CACHE",  # the fused primitives' compiled C kernels
    "MULTICOMPOSITE_NATIVE_KERNELS",
    "MULTICOMPOSITE_FUSED",
})


class SettingsError(ValueError):
    """A setting is missing, unknown or has a value that cannot work; the message is one line naming it."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="forbid")

    db: str | None = Field(default=None, description="SQLAlchemy URL; default: SQLite in the user data dir")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=PORTS[0], le=PORTS[1])
    token: str | None = Field(default=None, description="when set, the routes that write the store or start work "
                              "(POST /verify, POST /profiles, DELETE /jobs/{id}) need Authorization: Bearer")
    queue_size: int = Field(default=8, ge=1, le=10_000)
    max_numel: int = Field(default=MAX_NUMEL, ge=1, description="elements per tensor a profiling job may use")
    max_batch: int = Field(default=MAX_BATCH, ge=1, description="samples per batch a profiling job may time")
    max_contexts: int = Field(default=MAX_CONTEXTS, ge=1, description="(op, stack, batch, dtype) contexts per job")
    job_timeout_s: float = Field(default=600.0, gt=0)
    job_retention_s: float = Field(default=7 * 24 * 3600.0, gt=0, description="finished jobs are deleted after this")
    max_body_bytes: int = Field(default=1 << 20, ge=1)
    evidence_poll_s: float = Field(default=0.25, gt=0, le=1.0,
                                   description="how often the server checks the store's generation")
    cache_size: int = Field(default=2048, ge=1, le=1_000_000, description="cached responses (LRU)")
    cache_bytes: int = Field(default=64 << 20, ge=1 << 16, description="bytes of cached response bodies (LRU)")
    jobs: Literal["auto", "in-process", "workers"] = Field(
        default="auto", description="where verify and profile jobs run: auto (on `multicomposite worker` processes "
                                    "with a PostgreSQL store, in this process with SQLite), in-process, or workers")

    @field_validator("jobs")
    @classmethod
    def _workers_need_postgres(cls, value: str, info: ValidationInfo) -> str:
        db = info.data.get("db")
        if value == "workers" and not (db or "").startswith("postgresql"):
            raise ValueError("needs a PostgreSQL store (MULTICOMPOSITE_DB=postgresql+psycopg://USER@HOST/DB); with "
                             "SQLite, jobs run in process")
        return value

    @field_validator("token")
    @classmethod
    def _token_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("is set but empty; set a secret, or unset it to serve without auth")
        return value


def _one_line(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        name = ".".join(str(p) for p in item["loc"]) or "settings"
        given = item.get("input")
        shown = f"={str(given)[:40]!r}" if isinstance(given, (str, int, float)) else ""
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "is not a setting"
        parts.append(f"{PREFIX}{name.upper()}{shown}: {message}")
    return "; ".join(parts)


def check_variable_names() -> None:
    """SettingsError naming the first ``MULTICOMPOSITE_*`` variable of the environment that nothing reads: a
    misspelt ``MULTICOMPOSITE_DB`` would otherwise leave a command on the default store without a word."""
    known = {PREFIX + name.upper() for name in Settings.model_fields}
    unknown = sorted(name for name in os.environ
                     if name.startswith(PREFIX) and name not in known and name not in LIBRARY_VARIABLES)
    if unknown:
        raise SettingsError(f"{unknown[0]} is not a setting; the service's settings are {', '.join(sorted(known))}; "
                            f"the library's are {', '.join(sorted(LIBRARY_VARIABLES))}")


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment and ``overrides`` (None: not given); SettingsError, one line, otherwise."""
    check_variable_names()
    try:
        return Settings(**{name: value for name, value in overrides.items() if value is not None})
    except ValidationError as error:
        raise SettingsError(_one_line(error)) from None
