"""argparse that reports a usage error in one line (no usage block) and exits 2, by raising ``ParserExit`` rather
than calling ``sys.exit``: ``main`` returns the code, so tests and embedders keep their process."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ParserExit(Exception):  # noqa: N818 -- a way out of argparse, not a failure
    """argparse finished early: ``--help`` or ``--version`` (code 0) or a usage error, already printed (code 2)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise ParserExit(2)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise ParserExit(status)


class VersionAction(argparse.Action):
    """``--version``: the package's version, read only when asked (reading it imports the registry, and torch)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version of multicomposite and of torch, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        import torch

        import registry

        print(f"multicomposite {registry.__version__} (torch {torch.__version__})")
        parser.exit(0)
