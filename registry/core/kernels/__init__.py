"""The compiled kernels (``routing.cpp``, the routing; ``fused_ops.cpp``, the fused primitives as C++ ops), one
extension: built once per (torch, Python, compiler flags, sources) into a cache folder, then loaded from it in
milliseconds; never downloaded.

``build_kernels()`` (or ``multicomposite build-kernels``) compiles them ahead of time; otherwise the first ``use()``
starts the compile in a background process (about a minute on two cores) and routes with the Python kernels until
it lands (``background.py``). One compile serves every process: the build runs under a file lock in the cache
folder, and a build appears in it whole (a temporary folder renamed) or not at all. The cache folder is
``$MULTICOMPOSITE_KERNELS_DIR`` when set, else ``~/.cache/multicomposite/kernels``; each build lives in a subfolder
named by the hash of what it depends on.

Without a compiler or the headers (``DynamicLayer.h`` includes ``<nlohmann/json.hpp>``, which the torch wheel does not
ship: Debian's ``nlohmann-json3-dev``), ``load()`` raises KernelBuildError saying why; the routing then runs its
Python kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

# One extension: the routing kernels, the fused primitives, group norm and linear as C++ ops (``fused_ops.cpp``,
# ``group_norm.cpp``, ``linear.cpp``: their TORCH_LIBRARY registrations run when the extension loads), the random
# state's copy, and the batching rules that the routing registers (``batch_rules.cpp``), the graph check of
# first-order grad (``first_order.cpp``), the LSTM recurrence primitive's steps (``recurrence.cpp``), and the buffers of
# a batched-buffers region (``fresh_buffers.cpp``), and the rows ops of indexing and index_add (``rows.cpp``).
SOURCES = tuple(Path(__file__).with_name(name) for name in ("routing.cpp", "fused_ops.cpp", "random_state.cpp",
                                                                "batch_rules.cpp", "group_norm.cpp",
                                                                "linear.cpp", "first_order.cpp", "entries.cpp",
                                                                "output_pool.cpp", "recurrence.cpp",
                                                                "fresh_buffers.cpp", "rows.cpp"))
# Included by the sources: part of what a build depends on (build_id), not compiled on their own.
HEADERS = (Path(__file__).with_name("functorch_levels.h"),)
CACHE_ENV = "MULTICOMPOSITE_KERNELS_DIR"
# -O3: gcc vectorizes the fused ops' loops only there (its -O2 cost model refuses loops of unknown length).
# -fopenmp: at::parallel_for is a header template over OpenMP (ATen/ParallelOpenMP.h); without the flag its pragma is
# ignored and our row kernels run on one thread. The extension binds to the libgomp PyTorch has already loaded (one
# OpenMP runtime, its thread count torch.set_num_threads's).
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-fopenmp", "-w")
HOW_TO = ("install a C++ compiler and nlohmann-json (Debian: apt-get install g++ nlohmann-json3-dev), then run "
          "`multicomposite build-kernels`")


class KernelBuildError(RuntimeError):
    """The routing kernels could not be compiled or loaded; the message says why and how to fix it."""


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "multicomposite" / "kernels"


def _compiler() -> str | None:
    configured = os.environ.get("CXX")
    return shutil.which(configured) if configured else (shutil.which("c++") or shutil.which("g++"))


def _command(compiler: str, output: Path, name: str) -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libraries = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, *FLAGS, *(str(source) for source in SOURCES), "-o", str(output),
        f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in includes), *(f"-L{path}" for path in libraries),
        *(f"-Wl,-rpath,{path}" for path in libraries), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
    ]


def build_id() -> str:
    """What a build depends on: torch, Python, the compiler flags and the sources (not the compiler's path, so that a
    runtime image without a compiler loads what its build stage compiled)."""
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, " ".join(FLAGS),
                 *(source.read_text() for source in (*SOURCES, *HEADERS))):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def extension_path() -> Path:
    """Where the compiled extension of this torch, Python and source lives (whether or not it is built)."""
    identity = build_id()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_root() / identity / f"multicomposite_routing_{identity}{suffix}"


class LoadListeners:
    """Who is told once the extension loads in this process (its C++ ops registered): the selectors, whose cached
    decisions judged the cpp_op kind invalid while the kernels were not there (a background build that lands, a
    build another process made). Held weakly: a registry's selector goes with its registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._methods: list[weakref.WeakMethod[Callable[[], None]]] = []

    def add(self, method: Callable[[], None]) -> None:
        """Call the bound method ``method`` (weakly held) each time the extension loads."""
        with self._lock:
            self._methods = [m for m in self._methods if m() is not None]
            self._methods.append(weakref.WeakMethod(method))

    def notify(self) -> None:
        with self._lock:
            methods = [m() for m in self._methods]
        for method in methods:
            if method is not None:
                method()


LOADED = LoadListeners()
_lock = threading.Lock()
_module: ModuleType | None = None


def build_kernels(*, quiet: bool = False) -> Path:
    """Compile the kernels into the cache unless they are there; returns the extension's path.

    Raises KernelBuildError saying what is missing or what the compiler said."""
    try:
        return _build(quiet)
    except OSError as error:  # the cache folder cannot be written, the compiler cannot be started
        raise KernelBuildError(f"building the routing kernels in {cache_root()} failed: {error}; set {CACHE_ENV} "
                               "to a writable folder, or " + HOW_TO) from error


def _build(quiet: bool) -> Path:
    """Build under two locks: a thread's (``_lock``) and the cache folder's (an inter-process file lock), so that N
    processes starting at once compile once: the first compiles, the others wait for it and load its build. The
    compiler writes into a temporary folder beside the build's, renamed to it when the compile succeeded: a compile
    killed halfway leaves only that temporary folder, which no process loads and the next build removes."""
    with _lock:
        path = extension_path()
        if path.exists():
            return path
        # torch depends on it: a kept inter-process lock (fcntl.flock on POSIX). Imported only to build: the import
        # alone costs a first use() about 15 ms where the build is there already.
        from filelock import FileLock
        compiler = _compiler()
        if compiler is None:
            raise KernelBuildError(f"no C++ compiler found (c++ or g++ on PATH, or $CXX); {HOW_TO}")
        root = cache_root()
        root.mkdir(parents=True, exist_ok=True)
        identity = path.parent.name
        lock = FileLock(root / f"{identity}.lock")
        try:
            lock.acquire(timeout=0)
        except TimeoutError:  # filelock.Timeout: another process compiles this build now
            if not quiet:
                print(f"multicomposite: waiting for another process compiling the routing kernels into {root}",
                      file=sys.stderr, flush=True)
            lock.acquire()
        try:
            if path.exists():  # the other process built it while this one waited
                return path
            return _compile(compiler, path, quiet)
        finally:
            lock.release()


def _compile(compiler: str, path: Path, quiet: bool) -> Path:
    """Compile into a fresh temporary folder, then rename it to the build's folder (one atomic step). Called with
    the cache's file lock held: any temporary folder of this build left there is a killed compile's."""
    root, identity = path.parent.parent, path.parent.name
    for stale in root.glob(f".{identity}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    if path.parent.exists():  # a folder without the extension: an older layout's partial build
        shutil.rmtree(path.parent)
    if not quiet:
        print(f"multicomposite: compiling the routing kernels into {path.parent} (once; one to three minutes)",
              file=sys.stderr, flush=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{identity}.", dir=root))
    try:
        name = path.name.partition(".")[0]
        done = subprocess.run(_command(compiler, staging / path.name, name), capture_output=True, text=True)
        if done.returncode != 0 or not (staging / path.name).exists():
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            first = errors[0].strip() if errors else f"exit status {done.returncode}"
            if "nlohmann/json.hpp" in done.stderr:
                first = "the header <nlohmann/json.hpp> is missing (functorch's DynamicLayer.h includes it)"
            names = " and ".join(source.name for source in SOURCES)
            raise KernelBuildError(f"compiling {names} failed: {first}; {HOW_TO}")
        staging.chmod(0o755)  # mkdtemp's folder is private; the cache may be shared by a team's image
        staging.rename(path.parent)  # atomic: every process sees either no build or a whole one
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path


def built() -> bool:
    """Whether this torch's, Python's and source's build is in the cache (a stat: it loads nothing)."""
    return extension_path().exists()


def load(*, wait: bool = True) -> ModuleType | None:
    """The kernels' module, built first when the cache has none. Raises KernelBuildError.

    ``wait=False`` (the first ``use()``): where the cache has no build yet, start one in the background
    (``background.BUILD``) and return None at once; the routing switches to the kernels when it lands."""
    global _module
    if _module is not None:
        return _module
    if not wait and not built():
        if _compiler() is None:
            raise KernelBuildError(f"no C++ compiler found (c++ or g++ on PATH, or $CXX); {HOW_TO}")
        from registry.core.kernels.background import BUILD

        BUILD.start()
        return None
    path = build_kernels()
    name = path.name.partition(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot load {path}: not a Python extension; delete it and run "
                               "`multicomposite build-kernels`")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise KernelBuildError(f"loading {path} failed: {error}; delete {path.parent} and run "
                               "`multicomposite build-kernels`") from error
    _module = module
    LOADED.notify()  # decisions cached before judged the cpp_op kind without its ops: made again from now on
    return module


def loaded() -> ModuleType | None:
    """The kernels' module where this process has loaded it, else None (never builds or loads)."""
    return _module


def fused_ops_available() -> bool:
    """Whether the fused primitives' C++ ops (``fused_ops.cpp``: ``torch.ops.multicomposite.fill`` and the others)
    are registered in this process: the extension is loaded, or it is built and loads now (a stat, then
    milliseconds). Never compiles: where no build is there yet, False (the first ``use()`` starts one)."""
    if _module is not None:
        return True
    if not built():
        return False
    try:
        load()
    except KernelBuildError:
        return False
    return True
