"""Where in the user's code a call came from: the innermost frame outside PyTorch and this package.

An error raised under a transform surfaces deep inside PyTorch (the batching rule, functorch's wrappers) and this
package (the routing kernels); what the user needs is the line of their own code that made the call. The frames are
read from the live stack (a kernel that raises now) or from a traceback (an error caught after it unwound).
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass
from types import FrameType, TracebackType

import torch

# Files under these directories are never the user's line: PyTorch, this package, its composites and its service.
# contextlib and functools wrap user functions (``@use()``, ``functools.wraps``).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                 *(os.path.join(_PACKAGE_ROOT, package) + os.sep for package in ("registry", "composites", "service")))
_LIBRARY_FILES = frozenset(os.path.join(os.path.dirname(os.__file__), name) for name in ("contextlib.py",
                                                                                         "functools.py"))


@dataclass(frozen=True)
class UserFrame:
    """One frame of the user's code: where it is, its source line, and the frame itself (its variables)."""

    filename: str
    lineno: int
    source: str
    frame: FrameType

    @property
    def where(self) -> str:
        """``file:line``, the form editors and terminals open."""
        return f"{self.filename}:{self.lineno}"

    def describe(self) -> str:
        """``file:line (`source`)``; the source is left out where the file cannot be read."""
        return f"{self.where} (`{self.source}`)" if self.source else self.where


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is neither PyTorch's, this package's nor a standard wrapper's (nor generated code)."""
    return (not filename.startswith(_LIBRARY_DIRS) and filename not in _LIBRARY_FILES
            and not filename.startswith("<frozen"))


def _user_frame(frame: FrameType, lineno: int) -> UserFrame:
    filename = frame.f_code.co_filename
    return UserFrame(filename, lineno, linecache.getline(filename, lineno).strip(), frame)


def calling_user_frame(skip: int = 1) -> UserFrame | None:
    """The innermost user frame on the live stack, above this call's ``skip`` frames; None if there is none."""
    frame: FrameType | None = sys._getframe(skip)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return _user_frame(frame, frame.f_lineno)
        frame = frame.f_back
    return None


def raising_user_frame(traceback: TracebackType | None) -> UserFrame | None:
    """The innermost user frame of a caught error's traceback (the line that made the failing call)."""
    found = None
    while traceback is not None:
        frame = traceback.tb_frame
        if is_user_file(frame.f_code.co_filename):
            found = _user_frame(frame, traceback.tb_lineno)
        traceback = traceback.tb_next
    return found
