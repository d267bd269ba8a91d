"""Which install extra holds a library a command needs: without it the command says so in one line and exits 2.

The library (``registry``, ``composites``) needs torch alone; the service, the store, the workers and the plots each
come with an extra (pyproject.toml). A command reaches for its libraries only when it runs, so a missing one shows
up as a ModuleNotFoundError naming it; this module turns that error into the line that says what to install.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# The top-level module a library installs -> the extra of pyproject.toml that installs it.
EXTRA_OF_MODULE: dict[str, str] = {
    "fastapi": "service",
    "fastapi_offline": "service",
    "uvicorn": "service",
    "uvloop": "service",
    "httptools": "service",
    "pydantic": "service",
    "pydantic_settings": "service",
    "prometheus_client": "service",
    "sqlalchemy": "service",
    "alembic": "service",
    "rich": "service",
    "psycopg": "postgres",
    "procrastinate": "workers",
    "matplotlib": "plots",
    "expecttest": "dev",  # PyTorch's OpInfo database (the survey) imports it
}


def extra_for(error: ModuleNotFoundError) -> str | None:
    """The extra that installs the module ``error`` could not find; None when no extra does (a real bug)."""
    return EXTRA_OF_MODULE.get((error.name or "").partition(".")[0])


def command_of(argv: Sequence[str]) -> str:
    """The subcommand named in ``argv`` (its first word that is not an option); ``""`` when there is none."""
    return next((word for word in argv if not word.startswith("-")), "")


def missing_extra_line(error: ModuleNotFoundError, argv: Sequence[str]) -> str | None:
    """The one line a command prints when a library of an extra is missing; None when ``error`` is of no extra."""
    extra = extra_for(error)
    if extra is None:
        return None
    command = " ".join(filter(None, ("multicomposite", command_of(argv))))
    return (f"{command} needs the {extra!r} extra ({error.name} is not installed): "
            f"pip install 'multicomposite[{extra}]' torch==2.13.0")


def report_missing_extra(error: ModuleNotFoundError, argv: Sequence[str] | None) -> int:
    """Print the line for ``error`` and return exit code 2; re-raise an error that no extra would fix."""
    line = missing_extra_line(error, sys.argv[1:] if argv is None else argv)
    if line is None:
        raise error
    print(line, file=sys.stderr)
    return 2
