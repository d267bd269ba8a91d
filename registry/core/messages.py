"""How an error is quoted in a stored detail or a one-line message: its first line, cut short.

A traceback's text can be long (PyTorch's errors quote whole schemas); a detail that is stored or printed keeps the
first line only, so every table cell and CLI line stays one line.
"""

from __future__ import annotations

DETAIL_LIMIT = 300  # characters of an error's first line that a detail keeps


def first_line(error: BaseException | Warning | str, limit: int = DETAIL_LIMIT) -> str:
    """The first line of ``error``'s message (an exception, a warning or text), at most ``limit`` characters; ``""``
    when it has no message."""
    return (str(error).strip().splitlines() or [""])[0][:limit]


def described(error: BaseException, limit: int = DETAIL_LIMIT) -> str:
    """``"TypeName: first line"`` (``"TypeName"`` alone when the message is empty)."""
    line = first_line(error, limit)
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
