"""Where the store is and how a connection to it starts: no table in here, so the tables (``db``) and the migrations
(``migrate``) both build on it, and a caller can ask where the store is without importing SQLAlchemy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

ENV_VAR = "MULTICOMPOSITE_DB"
BUSY_TIMEOUT_MS = 30_000


class StoreUnavailableError(RuntimeError):
    """The store cannot be opened or read: a missing folder, a file that is not a database, a server down."""


class SchemaError(StoreUnavailableError):
    """The store's schema is not the one this code needs, and it was not (or cannot be) migrated on opening."""


def default_url() -> str:
    """``$MULTICOMPOSITE_DB`` if set, else a SQLite file in the user data dir (created if missing)."""
    url = os.environ.get(ENV_VAR)
    if url:
        return url
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    folder = Path(base) / "multicomposite"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'multicomposite.db'}"


def shown_url(url: str) -> str:
    """``url`` with a password masked (``***``), without SQLAlchemy: what a warning may show."""
    return re.sub(r"^([\w+.-]+://[^:/@]*):[^@]*@", r"\1:***@", url)


def default_store_exists() -> bool:
    """Whether the default store could hold anything: a URL in ``$MULTICOMPOSITE_DB``, or the SQLite file exists."""
    if os.environ.get(ENV_VAR):
        return True
    url = default_url()
    return not url.startswith("sqlite:///") or os.path.exists(url.removeprefix("sqlite:///"))


def sqlite_pragmas(dbapi_connection: Any, _record: Any, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
    """Set up a new SQLite connection: a busy timeout, and WAL (SQLAlchemy calls this on every connect)."""
    import sqlite3  # here: knowing where the store is needs no database driver

    from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_random

    def switch_to_wal() -> None:
        attempt = dbapi_connection.cursor()
        try:
            attempt.execute("PRAGMA journal_mode=WAL")
        finally:
            attempt.close()  # a failed statement left open keeps its shared lock: the other waiter would wait too

    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        # WAL lets readers proceed while a writer commits and keeps the file consistent if a writer is killed.
        # Switching a new file to WAL while another connection holds its lock fails at once (SQLite calls no busy
        # handler there): two processes creating one store together. Retry until the other is done.
        Retrying(retry=retry_if_exception_type(sqlite3.OperationalError), stop=stop_after_delay(busy_timeout_ms / 1000),
                 wait=wait_random(0.05, 0.1), reraise=True)(switch_to_wal)
    finally:
        cursor.close()
