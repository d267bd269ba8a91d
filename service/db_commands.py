"""``multicomposite db upgrade`` and ``multicomposite db current``: the store's schema migrations from the command
line (registry/store/migrate.py does the work). ``service/cli/__init__.py`` lists it as one row of its subcommand table
(``configure_db``)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def configure_db(db: Any) -> None:
    """Give the ``db`` subcommand's parser its actions, ``upgrade`` and ``current``."""
    db.description = ("The store's schema migrations (Alembic). The store is MULTICOMPOSITE_DB (default: a SQLite "
                      "file in the user data dir) unless --url says another.")
    actions = db.add_subparsers(dest="db_command", required=True, parser_class=type(db), metavar="ACTION",
                                help="upgrade or current; ACTION --help for its options")
    upgrade = actions.add_parser("upgrade", help="migrate the store to the newest schema (or to --revision)",
                                 description="Migrate the store in one transaction; a store made before migrations "
                                             "is adopted (its tables and rows kept). Safe to run from several "
                                             "machines at once: one migrates, the others find it done.")
    current = actions.add_parser("current", help="print the store's schema revision and the newest one")
    for action in (upgrade, current):
        action.add_argument("--url", default=None,
                            help="the store's SQLAlchemy URL (default: MULTICOMPOSITE_DB, else the SQLite file in "
                                 "the user data dir)")
        action.add_argument("--json", action="store_true", help="print the result as one JSON object")
    upgrade.add_argument("--revision", default="head",
                         help="the revision to migrate to (default: head, the newest); see `db current`")
    upgrade.set_defaults(run=_upgrade)
    current.set_defaults(run=_current)


def _fail(message: str) -> Exception:
    from service.cli_output import UsageError

    return UsageError(message)


def _url(args: argparse.Namespace) -> tuple[str, str]:
    from registry.store.connection import default_url
    from registry.store.database import safe_url

    url = args.url or default_url()
    return url, safe_url(url)


def _driver_error(shown: str, error: Exception) -> Exception:
    first = (str(error).strip().splitlines() or [""])[0]
    return _fail(f"the store at {shown} cannot be reached: {type(error).__name__}: {first}; check the URL "
                 "(MULTICOMPOSITE_DB or --url) and that the server is up")


def _upgrade(args: argparse.Namespace) -> int:
    from alembic.util import CommandError
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from registry.store import migrate

    url, shown = _url(args)
    try:
        before, after = migrate.upgrade(url, args.revision)
    except CommandError as error:  # an unknown or ambiguous revision
        raise _fail(f"cannot upgrade to {args.revision!r}: {error}; known revisions: "
                    f"{', '.join(migrate.revisions())}") from None
    except ArgumentError as error:
        raise _fail(f"{shown} is not a database URL: {error}") from None
    except SQLAlchemyError as error:
        raise _driver_error(shown, error) from None
    head = migrate.head()
    if args.json:
        print(json.dumps({"url": shown, "before": before, "after": after, "head": head}))
    elif before == after:
        print(f"the store at {shown} is at revision {after}{' (head)' if after == head else ''} already")
    else:
        print(f"the store at {shown}: {before or 'no schema'} -> {after}{' (head)' if after == head else ''}")
    return 0


def _current(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from registry.store import migrate

    url, shown = _url(args)
    try:
        revision = migrate.current(url)
    except ArgumentError as error:
        raise _fail(f"{shown} is not a database URL: {error}") from None
    except SQLAlchemyError as error:
        raise _driver_error(shown, error) from None
    head = migrate.head()
    if args.json:
        print(json.dumps({"url": shown, "current": revision, "head": head, "up_to_date": revision == head}))
    elif revision is None:
        print(f"the store at {shown} has no schema revision (not migrated); the newest is {head}: run "
              "`multicomposite db upgrade`")
    elif revision == head:
        print(f"the store at {shown} is at revision {revision} (head)")
    else:
        print(f"the store at {shown} is at revision {revision}; the newest is {head}: run `multicomposite db upgrade`")
    return 0
