"""``multicomposite build-kernels``: compile use()'s C++ routing kernels into their cache ahead of the first use()
(registry/core/kernels does the work)."""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Compile the C++ routing kernels once per torch, Python and compiler flags into the cache "
                          "folder (MULTICOMPOSITE_KERNELS_DIR, default ~/.cache/multicomposite/kernels); a cached "
                          "build is reused. Needs a C++ compiler and nlohmann-json (Debian: g++ "
                          "nlohmann-json3-dev). Without them use() runs its Python kernels.")
    parser.set_defaults(run=build_kernels)


def build_kernels(args: argparse.Namespace) -> int:
    from registry.core import kernels

    try:
        path = kernels.build_kernels()
        kernels.load()
    except kernels.KernelBuildError as error:
        print(f"multicomposite build-kernels: {error}", file=sys.stderr)
        return 1
    print(f"routing kernels: {path}")
    return 0
