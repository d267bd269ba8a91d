"""Settings from the environment (``MULTICOMPOSITE_`` prefix) or the command line."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MULTICOMPOSITE_")

    db: str | None = Field(default=None, description="SQLAlchemy URL; default: SQLite in the user data dir")
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = Field(default=None, description="when set, POST and DELETE need Authorization: Bearer")
    queue_size: int = Field(default=8, ge=1)
    max_numel: int = Field(default=2**24, ge=1, description="elements per tensor a profiling job may use")
    max_batch: int = Field(default=1024, ge=1)
    max_contexts: int = Field(default=256, ge=1, description="(op, stack, batch, dtype) contexts per job")
    job_timeout_s: float = Field(default=600.0, gt=0)
    max_body_bytes: int = 1 << 20
