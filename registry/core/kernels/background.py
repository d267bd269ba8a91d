"""The first ``use()`` never waits for the compiler: the C++ kernels compile in another process while the Python
kernels route, and the routing switches to the C++ ones once they are built.

``BUILD.start()`` runs ``build_kernels()`` in a child Python process (the kernels' module loaded from its file alone:
the child imports torch and nothing of the registry), under the cache folder's file lock, so that a child and any
number of other processes compile once. The child outlives a short parent: its build lands in the cache for the
next process. A thread of this process waits for the child and marks the build ``landed``; the routing then
switches backends at its next ``use()`` entry outside any other ``use()`` (never inside a kernel call), or says once
why the build failed and keeps the Python kernels. Decisions do not depend on the backend, so results are the same
before and after the switch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

# Run by the child, at a lower priority (it and its compiler yield the cores to the program that started it): build,
# and say why not in one line on stderr.
_CHILD = """
import importlib.util, os, sys
try:
    os.nice(10)
except (AttributeError, OSError):
    pass
spec = importlib.util.spec_from_file_location("multicomposite_kernel_build", sys.argv[1])
kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernels)
try:
    kernels.build_kernels(quiet=True)
except kernels.KernelBuildError as error:
    print(error, file=sys.stderr)
    sys.exit(1)
"""


class BackgroundBuild:
    """One background build of the kernels for this process: started at most once, waited for by a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        self._finished = threading.Event()
        self.landed = False  # finished and not yet taken by the routing: read at each use() entry (no lock)
        self.error: str | None = None  # why the build failed, once finished

    @property
    def started(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        """Start the build in a child process, unless this process started one already."""
        with self._lock:
            if self._process is not None:
                return
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(Path(__file__).with_name("__init__.py"))],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True,  # a Ctrl-C in the terminal stops the program, not the build it left behind
                env={**os.environ, "PYTHONWARNINGS": "ignore"})
            threading.Thread(target=self._wait, args=(self._process,), name="multicomposite-kernel-build",
                             daemon=True).start()

    def _wait(self, process: subprocess.Popen[str]) -> None:
        _, stderr = process.communicate()
        if process.returncode != 0:
            lines = [line for line in stderr.splitlines() if line.strip()]
            self.error = lines[-1].strip() if lines else f"the build process ended with status {process.returncode}"
        self._finished.set()
        self.landed = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the build to finish (tests, and a program that wants the C++ kernels before it times itself);
        whether it finished. Returns at once when none was started."""
        if self._process is None:
            return True
        return self._finished.wait(timeout)

    def adopt(self, switch: Callable[[], None], *, inside_use: bool) -> None:
        """Called by ``use()`` once the build ``landed``: ``switch()`` to the C++ kernels outside any other
        ``use()`` (inside one, at a later entry), or warn once why the build failed."""
        if inside_use:
            return
        with self._lock:
            if not self.landed:
                return
            self.landed = False
        if self.error is not None:
            _fallback(self.error)
            return
        from registry.core.kernels import KernelBuildError

        try:
            switch()
        except KernelBuildError as error:  # built, but it does not load here
            _fallback(str(error))


def _fallback(reason: str) -> None:
    warnings.warn(f"multicomposite: use() runs its Python routing kernels (a few microseconds more per call under a "
                  f"transform): {reason}; or set MULTICOMPOSITE_ROUTING=python to choose them", stacklevel=5)


BUILD = BackgroundBuild()
