"""The command line's argument types: each turns text into a value or raises ``argparse.ArgumentTypeError`` with one
line saying what is valid. Shared by every command (and ``multicomposite worker``); each imports what it checks
against only when called, so that building the parser loads neither torch nor the registry."""

from __future__ import annotations

import argparse
from pathlib import Path

from service.limits import MAX_BATCH, PORTS

# The dtypes verify and profile run: the floating point ones the samples are written for.
RUN_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _shorten(value: object, limit: int = 40) -> str:
    """``registry.core.stacks.shorten`` without importing the registry (and torch) to build an error line."""
    from registry.core.stacks import shorten

    return shorten(value, limit)


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def positive_int(text: str) -> int:
    value = _int(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"{_shorten(text)!r} is not a positive whole number")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"{_shorten(text)!r} is not a whole number of at least 0")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{_shorten(text)!r} is not a positive number of seconds")
    return value


def batch_size(text: str) -> int:
    """A profiling batch: 1..MAX_BATCH, the bound POST /profiles applies by default."""
    value = positive_int(text)
    if value > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"batch size {_shorten(text)} is over the limit of {MAX_BATCH} (the same "
                                         "bound as the API's MULTICOMPOSITE_MAX_BATCH default)")
    return value


def port(text: str) -> int:
    value = _int(text)
    low, high = PORTS
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{_shorten(text)!r} is not a TCP port: use {low}..{high}")
    return value


def run_dtype(text: str) -> str:
    if text not in RUN_DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {_shorten(text)!r}; choose from {', '.join(RUN_DTYPES)}")
    return text


def any_dtype(text: str) -> str:
    from service.validation import InputError, parse_dtype

    try:
        parse_dtype(text)  # a fixed table: an unknown name never reaches getattr(torch, ...)
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.removeprefix("torch.")


def stack(text: str) -> tuple[str, ...]:
    from registry.core.stacks import parse_bounded_stack

    try:
        return parse_bounded_stack(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def workload(text: str) -> str:
    from registry.core.stacks import canonical_workload
    from registry.profiling.timing import WORKLOADS

    try:
        name = canonical_workload(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {_shorten(text)!r}; workloads are {', '.join(WORKLOADS)}")
    return name


def device(text: str) -> str:
    from service.validation import InputError, host_device_types, parse_device

    try:
        parse_device(text, host_device_types())
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def op(text: str) -> str:
    import registry
    from registry.core.selector import unknown_op_message

    registry.load()
    if text not in registry.OPS:
        raise argparse.ArgumentTypeError(unknown_op_message(text))
    return text


def png(text: str) -> Path:
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {_shorten(path.parent, 80)} does not exist; create it, or "
                                         "write the PNG elsewhere")
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{_shorten(path.name)!r} does not end in .png")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{_shorten(path, 80)} is a folder; name a PNG file inside it")
    return path


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true",
                        help=f"print {what} as one JSON document on stdout, and nothing else there")
