#!/usr/bin/env python3
"""Wait until the store named by MULTICOMPOSITE_DB answers ``SELECT 1`` (and, with --schema-current, is at the newest
schema revision), then exit 0; exit 1 with one line naming the store and what it lacks when that does not happen
within --timeout seconds; exit 2 when MULTICOMPOSITE_DB is not set or not usable.

Why it exists: in the composed stack PostgreSQL and the one-shot ``migrate`` container start beside the service and
the worker. Compose's ``depends_on`` conditions (``service_healthy``, ``service_completed_successfully``) would order
them, but podman older than 4.6 (Debian bookworm has 4.3) ignores ``service_healthy``, runs no healthchecks without
systemd, and cannot start a container that depends on a finished one that has dependencies of its own. So each
container waits for what it needs itself: ``migrate`` for the server, the service and the worker for the schema.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError


def _where(url: str) -> str:
    """The store's address without its password, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def _answers(engine: Engine) -> str | None:
    """None when the store answers a query; else why not, in one line."""
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except DBAPIError as error:
        return " ".join(str(error.orig).split())
    return None


def _schema_current(url: str) -> str | None:
    """None when the store is at the newest schema revision; else where it stands, in one line."""
    from registry.store import migrate  # the project's migrations; only this check needs them

    revision = migrate.current(url)
    newest = migrate.head()
    if revision == newest:
        return None
    where = f"at schema revision {revision}" if revision else "not migrated (no schema revision)"
    return f"{where}, not at {newest}; is `multicomposite db upgrade` running (the migrate container)?"


def wait_for_store(url: str, timeout_s: float, interval_s: float = 1.0, schema_current: bool = False,
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> str | None:
    """None once ``url`` answers a query (and is at the newest schema when ``schema_current``); otherwise, once
    ``timeout_s`` has passed, the last reason it was not ready, as one line."""
    engine = create_engine(url, pool_pre_ping=False)
    deadline = clock() + timeout_s
    try:
        while True:
            reason = _answers(engine)
            if reason is None and schema_current:
                try:
                    reason = _schema_current(url)
                except DBAPIError as error:  # the server went away between the two checks
                    reason = " ".join(str(error.orig).split())
            if reason is None:
                return None
            if clock() + interval_s > deadline:
                return reason
            sleep(interval_s)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wait-for-store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait at most (default 60)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between tries (default 1)")
    parser.add_argument("--schema-current", action="store_true",
                        help="also wait until the store is at the newest schema revision (after `db upgrade`)")
    args = parser.parse_args(argv)
    url = os.environ.get("MULTICOMPOSITE_DB", "")
    if not url:
        print("wait-for-store: MULTICOMPOSITE_DB is not set; set it to the store's SQLAlchemy URL", file=sys.stderr)
        return 2
    try:
        where = _where(url)
        reason = wait_for_store(url, args.timeout, args.interval, args.schema_current)
    except (ArgumentError, ModuleNotFoundError) as problem:
        print(f"wait-for-store: MULTICOMPOSITE_DB cannot be used: {problem}", file=sys.stderr)
        return 2
    if reason is not None:
        print(f"wait-for-store: {where} not ready within {args.timeout:g} s: {reason}", file=sys.stderr)
        return 1
    print(f"wait-for-store: {where} {'is at the newest schema' if args.schema_current else 'answers'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
