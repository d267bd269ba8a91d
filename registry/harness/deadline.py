"""A deadline for one case: a case that runs too long is an error outcome, not a hung survey."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

DEFAULT_CASE_TIMEOUT_S = 20.0


class CaseTimeout(Exception):  # noqa: N818 -- an outcome, not a failure
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after ``seconds`` (a kernel that never returns to Python is left to the
    worker's own deadline)."""
    if (seconds <= 0 or os.name != "posix" or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None)):
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise CaseTimeout(f"timed out after {seconds:g} s")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

