"""The ``multicomposite`` command line: verify, profile and choose among the decompositions of each PyTorch op
under torch.func transforms (vmap, grad, jvp, ...); read what the store holds; serve it over HTTP.

Each subcommand is one row of SUBCOMMANDS: its name, its help, a ``configure(parser)`` that adds its arguments and
sets ``run`` (``parser.set_defaults(run=...)``, a function of the parsed arguments returning the exit code), and
whether it only reads (a read command takes ``--json``; a test checks it). Each command lives in a module of its own
here (``service/cli/verify.py``, ...), with the argument types they share in ``service/cli/arguments.py``; a module
raises ``service.cli_output.UsageError`` for bad input (one line on stderr, exit 2) and writes through
``service.cli_output`` (tables, JSON, progress).

Only the command being run is configured, and every module imports torch, the registry and the service inside the
functions that need them: ``multicomposite --help`` answers without loading any of them.

Exit codes: 0 done; 1 done, but what ran found a failure (``verify``; ``check``: use() is not ok); 2 bad input, said
in one line on stderr; 3 the store refused a write or a read (disk full, read-only, server gone), said in one line,
nothing of the write stored; 130 interrupted (Ctrl-C), said in one line; 141 stdout was closed early
(``multicomposite ops | head``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.cli import (
    build_kernels,
    check,
    conformance,
    jobs,
    matrix,
    ops,
    profile,
    profiles,
    report,
    select,
    serve,
    survey,
    survey_results,
    verify,
)
from service.cli.parser import Parser, ParserExit, VersionAction
from service.cli_output import UsageError

DESCRIPTION = ("Verify, profile and choose among the decompositions of each PyTorch op under torch.func transforms "
               "(vmap, grad, jvp, ...): which one is correct and fastest under the active transform stack. Read "
               "what the store holds, and serve it over HTTP with a dashboard.")
EPILOG = ("start with `multicomposite ops`, then `multicomposite select index_fill --stack \"vmap(grad)\"`; "
          "`multicomposite verify` and `profile` fill the store that `select`, `matrix`, `report` and the service "
          "read; `multicomposite check model.py:loss --example model.py:make_args` checks your own function. Exit "
          "codes: 0 done, 1 a failure was found (verify, check), 2 bad input, 3 the store refused a write, "
          "130 interrupted.")


def _configure_db(parser: argparse.ArgumentParser) -> None:
    from service.db_commands import configure_db

    configure_db(parser)  # db upgrade, db current (service/db_commands.py)


def _configure_worker(parser: argparse.ArgumentParser) -> None:
    from service.cli.worker import configure_worker

    configure_worker(parser)  # `multicomposite worker`: service/cli/worker.py


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]  # adds the arguments; set_defaults(run=...)
    reads: bool = False  # only reads: takes --json


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("serve", "serve the HTTP API and the dashboard", serve.configure),
    Subcommand("ops", "list the covered ops and their composites", ops.configure, reads=True),
    Subcommand("select", "show the decision for an op under a stack, and every alternative's verdict",
               select.configure, reads=True),
    Subcommand("verify", "verify every composite under every stack; fill the store", verify.configure),
    Subcommand("matrix", "show the stored verified matrix, native's failures (--failing), or a heatmap (--png)",
               matrix.configure, reads=True),
    Subcommand("profile", "time every composite side by side with native; fill the store", profile.configure),
    Subcommand("profiles", "show the stored profiles", profiles.configure, reads=True),
    Subcommand("report", "show the speedup over native per op and workload; draw it with --png", report.configure,
               reads=True),
    Subcommand("survey", "run OpInfo's op_db under the stacks, natively and inside use(); fill the store",
               survey.configure),
    Subcommand("survey-results", "show the stored survey rows", survey_results.configure, reads=True),
    Subcommand("conformance", "run functorch's OpInfo checks on every covered op, natively and inside use(); fill "
               "the store", conformance.configure),
    Subcommand("check", "check your own transformed function: right natively and inside use()? what use() chose, "
               "and the three timings", check.configure),
    Subcommand("jobs", "show the verify and profile jobs the service has run or queued", jobs.configure,
               reads=True),
    Subcommand("db", "the store's schema: show its revision (db current), or upgrade it (db upgrade)",
               _configure_db),
    Subcommand("worker", "run verify and profile jobs for the device kinds of this machine (needs a PostgreSQL "
               "store)", _configure_worker),
    Subcommand("build-kernels", "compile use()'s C++ routing kernels into their cache (else the first use() does)",
               build_kernels.configure),
]


def build_parser(only: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, every command is listed but only those named get their arguments (what
    ``main`` does: configuring a command may import what its help lists)."""
    parser = Parser(prog="multicomposite", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action=VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND",
                                     help="one of the commands below; COMMAND --help for its options")
    for command in SUBCOMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        if only is None or command.name in only:
            command.configure(sub)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level takes no values)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _silence_stdout() -> None:
    """stdout was closed by its reader (``| head``): point it at /dev/null, so that flushing at exit stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real descriptor (a test's capture): nothing will flush into the pipe
        pass
    finally:
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except ModuleNotFoundError as error:  # a library of an extra that is not installed: say which extra
        from service.extras import report_missing_extra

        return report_missing_extra(error, argv)


def _main(argv: list[str]) -> int:
    named = _command_in(argv)
    parser = build_parser(only=[named] if named is not None else [])
    try:
        args, unknown = parser.parse_known_args(argv)
    except ParserExit as finished:
        return finished.code
    if unknown:  # argparse blames the top level ("see multicomposite --help"); the command is the one to read
        print(f"multicomposite {args.command}: unrecognized arguments: {' '.join(unknown)} (see multicomposite "
              f"{args.command} --help)", file=sys.stderr)
        return 2
    from registry.store.connection import StoreUnavailableError  # no driver: where the store is, and its errors

    try:
        return args.run(args)
    except UsageError as error:
        print(f"multicomposite {args.command}: {error}", file=sys.stderr)
        return 2
    except StoreUnavailableError as error:  # a write refused (disk full, read-only, server gone): nothing of it stored
        print(f"multicomposite {args.command}: {error}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as interrupt:
        why = f"; {interrupt}" if str(interrupt) else ""
        print(f"\nmulticomposite {args.command}: interrupted{why}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 141
