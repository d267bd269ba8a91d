"""The connection layer every store shares: the engine (SQLite's pragmas, PostgreSQL's timeouts), the schema checked
or migrated on opening, one transaction per write, and the checks that the store answers and is still the file this
process opened. The evidence store (``evidence_store``) and the jobs store (``job_store``) are both built on it.
"""

from __future__ import annotations

import functools
import math
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from registry.core.messages import first_line
from registry.store import connection
from registry.store.connection import StoreUnavailableError, default_url, sqlite_pragmas
from registry.store.tables import GENERATION, meta_table

CHECK_TIMEOUT_S = 5.0  # a readiness check waits this long for a lock, not a writer's 30 s


def safe_url(url: str) -> str:
    """``url`` with its password masked (``***``): what messages and logs may show of a server URL."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: nothing in it to hide that we could find
        return url


def data_dir(url: str) -> Path:
    """The folder beside a SQLite store, else the user data dir: where the benchmark lock lives."""
    if url.startswith("sqlite:///") and url.removeprefix("sqlite:///") not in ("", ":memory:"):
        return Path(url.removeprefix("sqlite:///")).parent
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    folder = Path(base) / "multicomposite"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Database:
    """A store's database (SQLite by default): its engine, its transactions and its health checks."""

    def __init__(self, url: str | None = None, *, create: bool = True, timeout_s: float | None = None) -> None:
        """Open the store at ``url``. With ``create``, check its schema revision (once, when a process opens it: a
        server does it in its lifespan, never per request): a SQLite file is created or migrated to the newest
        revision here; a server database below it raises SchemaError saying to run ``multicomposite db upgrade``
        (see registry/store/migrate.py for why).

        ``timeout_s`` bounds every wait of a reader that must not hang (the library's evidence read): SQLite's
        busy timeout; PostgreSQL's connect timeout (the whole handshake: a server that accepts and never answers),
        its statement timeout, and the TCP user timeout (a network that drops packets). Without it a writer waits
        ``BUSY_TIMEOUT_MS`` for SQLite's lock and 10 s for a server to answer a connect."""
        self.url = url if url is not None else default_url()
        self.display_url = safe_url(self.url)  # for messages: never the password
        options: dict[str, Any] = {}
        if not self.url.startswith("sqlite"):
            # A server restarts, or ends idle connections: test each pooled connection before handing it out, so
            # the first request after a restart gets a new one instead of an error.
            options["pool_pre_ping"] = True
            query = make_url(self.url).query
            connect_args: dict[str, Any] = {}
            if "connect_timeout" not in query:
                # A server that is down: fail in seconds (libpq counts whole seconds, at least 2).
                connect_args["connect_timeout"] = 10 if timeout_s is None else max(2, math.ceil(timeout_s))
            if timeout_s is not None:
                milliseconds = max(1, int(timeout_s * 1000))
                if "options" not in query:
                    connect_args["options"] = f"-c statement_timeout={milliseconds}"
                if "tcp_user_timeout" not in query:
                    connect_args["tcp_user_timeout"] = milliseconds
                options["pool_timeout"] = timeout_s
            if connect_args:
                options["connect_args"] = connect_args
        elif timeout_s is not None:
            options["connect_args"] = {"timeout": timeout_s}
        self.engine: Engine = create_engine(self.url, **options)
        self._sqlite = self.engine.dialect.name == "sqlite"
        if self._sqlite:
            # Read at each open (not bound at import): a test, or a deployment, may set it for the process.
            busy_ms = connection.BUSY_TIMEOUT_MS if timeout_s is None else max(1, int(timeout_s * 1000))
            event.listen(self.engine, "connect", functools.partial(sqlite_pragmas, busy_timeout_ms=busy_ms))
        if create:
            from registry.store.migrate import ensure_current

            try:
                ensure_current(self.engine, self.url, self.display_url)
            except BaseException:
                self.engine.dispose()  # a store that cannot be opened keeps no connection (nor its file) open
                raise
        self._replacing = threading.Lock()
        self._file_id = self._sqlite_file_id()

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for reads; a lost or refused connection becomes StoreUnavailableError saying so."""
        try:
            with self.engine.connect() as conn:
                yield conn
        except OperationalError as error:
            raise StoreUnavailableError(f"the store at {self.display_url} cannot be read: {type(error).__name__}: "
                                        f"{first_line(error)}") from error

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One transaction, committed when the block ends. A lost or refused connection (a server killed or
        restarted, a backend terminated, SQLite's file locked past the timeout) becomes StoreUnavailableError:
        before the commit, the transaction was rolled back by the database and nothing of it is stored; during the
        commit, whether it was stored cannot be known from here. A SQLite file deleted or replaced since this
        process opened it refuses the write (``_same_file``)."""
        self._same_file()
        stage = "write"
        try:
            with self.engine.connect() as conn, conn.begin():
                yield conn
                stage = "commit"
        except OperationalError as error:
            cause = f"{type(error).__name__}: {first_line(error)}"
            if stage == "commit":
                raise StoreUnavailableError(f"the store at {self.display_url} failed while committing a write "
                                            f"({cause}); whether it was stored is unknown, read it back once the "
                                            "store answers again") from error
            raise StoreUnavailableError(f"the store at {self.display_url} failed during a write ({cause}); it was "
                                        "rolled back, nothing of it is stored; retry once the store answers "
                                        "again") from error

    def data_dir(self) -> Path:
        return data_dir(self.url)

    def check(self) -> None:
        """Raise StoreUnavailableError saying why, unless the store answers a query.

        A SQLite file is checked through SQLite only, never opened by this process directly: closing any descriptor
        of a file drops every POSIX lock the process holds on it, SQLite's included, and another process closing its
        connection then takes itself for the last one and deletes the ``-wal`` and ``-shm`` files this process still
        writes into (https://www.sqlite.org/howtocorrupt.html, 2.2). SQLite's own connections share one descriptor
        per file in a process and keep it open while any of them holds a lock.
        """
        if self._sqlite:
            self._check_sqlite_file()
        try:
            with self.reading() as conn:  # the generation: one indexed read of a table every schema has
                conn.execute(select(meta_table.c.value).where(meta_table.c.key == GENERATION)).scalar()
        except StoreUnavailableError:
            raise
        except Exception as error:  # any driver error is the answer
            raise StoreUnavailableError(f"the store at {self.display_url} cannot be read: {type(error).__name__}: "
                                        f"{first_line(error)}") from error

    def _sqlite_path(self) -> str | None:
        """The SQLite file's path, or None (a server store, an in-memory one, a ``file:`` URI)."""
        if not self._sqlite:
            return None
        path = self.engine.url.database or ""
        return None if path in ("", ":memory:") or path.startswith("file:") else path

    def _sqlite_file_id(self) -> tuple[int, int] | None:
        """The SQLite file's device and inode (a stat: it opens nothing), or None when there is none."""
        path = self._sqlite_path()
        if path is None:
            return None
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

    def _same_file(self) -> None:
        """Raise StoreUnavailableError when the SQLite file at the path is not the one this process opened (a stat):
        a pooled connection would write into the deleted or moved file, which no other process reads, and the write
        would be lost. The service's check (``_check_sqlite_file``) reopens a replaced file; a command runs again."""
        with self._replacing:
            opened = self._file_id
        if opened is None:
            return
        now = self._sqlite_file_id()
        if now == opened:
            return
        what = "does not exist any more" if now is None else "was replaced by another file"
        raise StoreUnavailableError(f"the store file {self._sqlite_path()} {what} since this process opened it; "
                                    "nothing of this write is stored; put the file back, or run again to write the "
                                    "one there now")

    def _check_sqlite_file(self) -> None:
        """The file is there and is a SQLite database, read fresh: a pooled connection in WAL mode answers from its
        cache after the file was overwritten, so a new connection (``mode=rw``: it never creates a missing file)
        reads the generation from the file itself. A file replaced since the last check (restored from a backup,
        deleted and recreated) is reopened first (``_reopen_replaced``)."""
        path = self._sqlite_path()
        if path is None:
            return
        file_id = self._sqlite_file_id()
        if file_id is None:
            if not os.path.exists(path):
                raise StoreUnavailableError(f"the store file {path} does not exist")
            raise StoreUnavailableError(f"the store file {path} cannot be read (check its permissions)")
        with self._replacing:
            if self._file_id is not None and file_id != self._file_id:
                self._reopen_replaced()
            self._file_id = file_id
        try:
            fresh = sqlite3.connect(f"file:{quote(path)}?mode=rw", uri=True, timeout=CHECK_TIMEOUT_S)
        except sqlite3.Error as error:
            raise StoreUnavailableError(f"the store file {path} cannot be opened: {error}") from None
        try:
            fresh.execute("SELECT value FROM store_meta WHERE key = ?", (GENERATION,)).fetchall()
        except sqlite3.Error as error:
            if getattr(error, "sqlite_errorname", "") == "SQLITE_NOTADB":
                raise StoreUnavailableError(f"the store file {path} is not a SQLite database (bad header)") from None
            raise StoreUnavailableError(f"the store at {self.display_url} cannot be read: {type(error).__name__}: "
                                        f"{first_line(error)}") from None
        finally:
            fresh.close()

    def _reopen_replaced(self) -> None:
        """The file at the path is another one now; pooled connections still read the old one. The -wal beside it
        still holds the old file's pages, and SQLite closing a moved file leaves them there: the new file would
        read them as its own. So an idle pooled connection of the old file first moves them into that file and
        empties the -wal (``wal_checkpoint(TRUNCATE)``), then the pool closes. Only an idle one: a new connection
        would open the new file. Best effort: what SQLite can still save of a file replaced under it is saved."""
        if self.engine.pool.checkedin() > 0:  # type: ignore[attr-defined]
            try:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            except Exception:  # the old file is beyond saving; the new one is what counts now
                pass
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
    def integrity_ok(self) -> bool:
        """SQLite's ``PRAGMA integrity_check`` answered "ok"; always True for other backends."""
        if not self._sqlite:
            return True
        with self.reading() as conn:
            answers = [str(row[0]) for row in conn.execute(text("PRAGMA integrity_check"))]
        return answers == ["ok"]

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()
