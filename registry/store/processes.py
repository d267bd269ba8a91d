"""Who owns a stored row that a process holds (a job, a benchmarking run): ``host:pid``, and whether it still runs."""

from __future__ import annotations

import os
import socket


def this_process() -> str:
    """``host:pid``: who owns a job."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_alive(owner: str) -> bool:
    """Whether the ``host:pid`` process still runs; a process on another host is taken as alive (cannot tell)."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True
