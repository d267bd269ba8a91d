"""Whether the store the library reads its evidence from can be read, and what ``use()`` does when it cannot.

The store is advice: ``use()`` never fails because of it. A read that fails (a file that is not a database, a folder
that cannot be created, a server that is down or does not answer, a schema newer than this code, a file made
unreadable) warns once per process, saying which store, what is wrong and how to fix it, and the selector decides
from the rules and the shipped reference profiles, exactly as with no store. Every wait is bounded
(``READ_TIMEOUT_S``: SQLite's lock, PostgreSQL's connect, statement and TCP timeouts). While the store cannot be
read it is tried again in the background every ``RETRY_S``; once a read succeeds the evidence is reloaded (the
decisions made without it are dropped), as the service's store watcher does.

Errors are recognised by their type: the drivers' (``sqlite3.Error``, SQLAlchemy's and psycopg's), the store's own
(``StoreUnavailableError``, ``SchemaError``) and the operating system's (``OSError``).
"""

from __future__ import annotations

import math
import os
import sqlite3
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from registry.store.connection import ENV_VAR, SchemaError, StoreUnavailableError

READ_TIMEOUT_S = 3.0  # the longest the first routed call waits for a store that does not answer
RETRY_S = 30.0  # how often a store that could not be read is tried again, in the background

FIX = (f"check it with `multicomposite db current`, or set {ENV_VAR} to a store that answers (unset: the default "
       "file under ~/.local/share/multicomposite)")


def store_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the store cannot be read": the drivers' base classes (those imported: a driver
    not imported raised nothing), the store's own, and the operating system's."""
    kinds: list[type[BaseException]] = [StoreUnavailableError, sqlite3.Error, OSError]
    if "sqlalchemy" in sys.modules:
        from sqlalchemy.exc import SQLAlchemyError

        kinds.append(SQLAlchemyError)
    if "psycopg" in sys.modules:
        import psycopg

        kinds.append(psycopg.Error)
    return tuple(kinds)


def describe(error: BaseException) -> str:
    """What is wrong, in one line, and how to fix it."""
    if isinstance(error, SchemaError):
        return str(error)  # says what to run or to update already
    cause = error.__cause__ if isinstance(error, StoreUnavailableError) and error.__cause__ else error
    origin = getattr(cause, "orig", None) or cause  # SQLAlchemy wraps the driver's error
    if isinstance(origin, sqlite3.DatabaseError) and getattr(origin, "sqlite_errorname", "") == "SQLITE_NOTADB":
        return (f"the file is not a SQLite database; restore it from a backup (sqlite3 store.db \".backup copy.db\" "
                f"makes one), or {FIX}")
    if isinstance(origin, PermissionError):
        return f"permission denied ({origin}); give this user access to it, or {FIX}"
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}; {FIX}"


@dataclass(frozen=True)
class StoreStatus:
    """Which store ``use()`` reads its evidence from, and whether it can.

    ``url``: the store's URL (password masked), or None where even its place cannot be told (no writable data
    folder); ``exists``: False where there is no store yet (nothing measured here: the rules and the reference
    profiles decide); ``readable``: a read succeeded just now; ``problem``: what is wrong and how to fix it."""

    url: str | None
    exists: bool
    readable: bool
    problem: str | None = None

    def __str__(self) -> str:
        if self.problem is not None:
            return f"the store at {self.url or '(unknown)'} cannot be read: {self.problem}"
        if not self.exists:
            return f"no store at {self.url} yet: the rules and the reference profiles decide"
        return f"the store at {self.url} is readable"


class StoreHealth:
    """This process's view of the store's readability: the warning given once, the problem, the retry timer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.problem: str | None = None  # what the last read said was wrong; None once a read succeeds
        self.url: str | None = None
        self.warned = False
        self.read: set[str] = set()  # stores read in this process (a file of them that vanishes was deleted)
        self._timer: threading.Timer | None = None
        self._epoch = 0  # bumped by reset(): a retry started before it leaves the new state alone
        self._failed_at = -math.inf  # time.monotonic() of the last failed read
        self.on_recovery: Callable[[], None] | None = None  # called once a retry reads the store
        self.probe: Callable[[], object] | None = None  # one read of the store; raises what store_errors() names

    def succeeded(self, url: str) -> None:
        with self._lock:
            self.url, self.problem = url, None
            self.read.add(url)

    def failed(self, url: str | None, error: BaseException, *, stacklevel: int = 2) -> None:
        """A read of the store at ``url`` failed with ``error``: warn once per process, then retry later."""
        problem = describe(error)
        with self._lock:
            self.url, self.problem = url, problem
            self._failed_at = time.monotonic()
            warn = not self.warned
            self.warned = True
            self._schedule()
        if warn:
            warnings.warn(f"multicomposite: the store at {url or '(no place for it)'} cannot be read: {problem}. "
                          f"use() decides from the rules and the reference profiles shipped with it until the store "
                          f"answers (tried again every {RETRY_S:g} s)", RuntimeWarning, stacklevel=stacklevel + 1)

    def failing(self) -> bool:
        """A read failed less than ``RETRY_S`` ago: the next read is the background retry's, not a decision's (a
        store that hangs would cost every read its timeout: the matrix's, then the profiles')."""
        return self.problem is not None and time.monotonic() - self._failed_at < RETRY_S

    def _schedule(self) -> None:
        if self._timer is None and self.probe is not None:
            self._timer = threading.Timer(RETRY_S, self._retry, (self._epoch,))
            self._timer.daemon = True
            self._timer.name = "multicomposite-store-retry"
            self._timer.start()

    def _retry(self, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            self._timer = None
        probe = self.probe
        if probe is None:
            return
        try:
            probe()
        except store_errors() as error:
            with self._lock:
                if epoch == self._epoch:
                    self.problem = describe(error)
                    self._schedule()
            return
        with self._lock:
            if epoch != self._epoch:
                return
            self.problem = None
        if self.on_recovery is not None:
            self.on_recovery()

    def cancel(self) -> None:
        """Stop retrying (tests; a process that set its own evidence source)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None

    def reset(self) -> None:
        """Forget the problem and the warning given (tests: a fresh process's view)."""
        self.cancel()
        with self._lock:
            self.problem, self.url, self.warned = None, None, False
            self._failed_at = -math.inf
            self.read.clear()
            self._epoch += 1

    def forked(self) -> None:
        """In a forked child: the parent's timer thread is not there; a failure here schedules its own."""
        self._lock = threading.Lock()
        self._timer = None


HEALTH = StoreHealth()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HEALTH.forked)
