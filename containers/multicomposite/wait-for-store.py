#!/usr/bin/env python3
"""Wait until the store named by MULTICOMPOSITE_DB answers ``SELECT 1``, then exit 0; exit 1 with one line naming the
store and the last error when it does not within --timeout seconds; exit 2 when MULTICOMPOSITE_DB is not set.

Why it exists: in the composed stack PostgreSQL starts beside the service. Compose's ``condition: service_healthy``
would order them, but podman older than 4.6 (Debian bookworm has 4.3) ignores that condition, and podman runs no
healthchecks without systemd; so the containers that need the database wait for it themselves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError


def _where(url: str) -> str:
    """The store's address without its password, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def wait_for_store(url: str, timeout_s: float, interval_s: float = 1.0) -> str | None:
    """None once ``url`` answers a query; otherwise, after ``timeout_s``, the last error as one line."""
    engine = create_engine(url, pool_pre_ping=False)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                with engine.connect() as connection:
                    connection.execute(text("SELECT 1"))
                return None
            except DBAPIError as error:
                last = " ".join(str(error.orig).split())
            if time.monotonic() + interval_s > deadline:
                return last
            time.sleep(interval_s)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wait-for-store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait at most (default 60)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between tries (default 1)")
    args = parser.parse_args(argv)
    url = os.environ.get("MULTICOMPOSITE_DB", "")
    if not url:
        print("wait-for-store: MULTICOMPOSITE_DB is not set; set it to the store's SQLAlchemy URL", file=sys.stderr)
        return 2
    try:
        where = _where(url)
        error = wait_for_store(url, args.timeout, args.interval)
    except (ArgumentError, ValueError, ModuleNotFoundError) as problem:
        print(f"wait-for-store: MULTICOMPOSITE_DB cannot be used: {problem}", file=sys.stderr)
        return 2
    if error is not None:
        print(f"wait-for-store: {where} did not answer within {args.timeout:g} s: {error}", file=sys.stderr)
        return 1
    print(f"wait-for-store: {where} answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
