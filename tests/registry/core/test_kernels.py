"""The compiled routing kernels: built once into their cache, loaded from it, and a working use() without them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import func

import registry
from registry.core import kernels, routing

# A process that routes one call under vmap and prints the backend, then the result's check.
ROUTED = ("import warnings, torch, registry\n"
          "from torch import func\n"
          "from registry.core.routing import routing_backend\n"
          "x, index = torch.randn(3, 4, 2), torch.tensor([1])\n"
          "for _ in range(2):\n"
          "    with registry.use(pins={'index_fill': 'functional'}):\n"
          "        y = func.vmap(lambda r: r.index_fill(0, index, 5.0))(x)\n"
          # A build started in the background (a compiler but no cached build) says how it ended at a later use().
          "from registry.core.kernels import background\n"
          "assert background.BUILD.wait(240)\n"
          "with registry.use(pins={'index_fill': 'functional'}):\n"
          "    y = func.vmap(lambda r: r.index_fill(0, index, 5.0))(x)\n"
          "print(routing_backend(), bool(y[:, 1].eq(5.0).all()))\n")


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-W", "always", "-c", ROUTED], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _fallback_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "runs its Python routing kernels" in line]


def test_without_a_compiler_use_runs_the_python_kernels_and_says_so_once(tmp_path: Path) -> None:
    done = _run({kernels.CACHE_ENV: str(tmp_path), "CXX": str(tmp_path / "no-such-compiler"),
                 routing.BACKEND_ENV: ""})
    assert done.stdout.split() == ["python", "True"]
    (line,) = _fallback_lines(done.stderr)
    assert "no C++ compiler found" in line and "multicomposite build-kernels" in line
    assert "apt-get install g++ nlohmann-json3-dev" in line


def test_a_missing_header_is_named(tmp_path: Path) -> None:
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\necho 'routing.cpp:3: fatal error: nlohmann/json.hpp: No such file' >&2\n"
                        "exit 1\n")
    compiler.chmod(compiler.stat().st_mode | stat.S_IXUSR)
    done = _run({kernels.CACHE_ENV: str(tmp_path / "cache"), "CXX": str(compiler), routing.BACKEND_ENV: ""})
    assert done.stdout.split() == ["python", "True"]
    (line,) = _fallback_lines(done.stderr)
    assert "<nlohmann/json.hpp> is missing" in line
    assert not list((tmp_path / "cache").rglob("*.so")), "a failed build leaves nothing to load"


def test_the_environment_forces_the_python_kernels_without_a_warning() -> None:
    done = _run({routing.BACKEND_ENV: "python"})
    assert done.stdout.split() == ["python", "True"]
    assert _fallback_lines(done.stderr) == []


def test_a_cached_build_loads_without_a_compiler(tmp_path: Path) -> None:
    """A runtime image keeps what its build stage compiled and has no compiler."""
    kernels.build_kernels(quiet=True)  # the default cache: the suite builds it once
    done = _run({"CXX": str(tmp_path / "no-such-compiler"), routing.BACKEND_ENV: ""})
    assert done.stdout.split() == ["cpp", "True"]
    assert _fallback_lines(done.stderr) == []


def test_the_build_folder_names_torch_python_flags_and_source(monkeypatch: pytest.MonkeyPatch) -> None:
    first = kernels.build_id()
    monkeypatch.setattr(kernels, "FLAGS", (*kernels.FLAGS, "-DSOMETHING"))
    assert kernels.build_id() != first
    monkeypatch.setattr(kernels, "FLAGS", kernels.FLAGS[:-1])
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert kernels.build_id() != first
    monkeypatch.setenv(kernels.CACHE_ENV, "/somewhere")
    assert kernels.extension_path().parent.parent == Path("/somewhere")


def test_an_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(registry.SelectionError, match="unknown backend 'fast'"):
        routing.set_routing_backend("fast")


@pytest.fixture
def cpp_backend():
    try:
        routing.set_routing_backend("cpp")
    except kernels.KernelBuildError as error:
        if os.environ.get("ROUTING_TEST_REQUIRE_CPP") == "1":
            pytest.fail(f"the C++ routing kernels cannot be built: {error}", pytrace=False)
        pytest.skip(f"C++ routing kernels unavailable: {error}")
    yield routing.ROUTER.cpp


def test_evidence_changes_clear_the_cpp_table(cpp_backend) -> None:
    x, index = torch.randn(3, 4, 2), torch.tensor([1])
    with registry.use():
        for _ in range(2):  # the first decision of a process may load the evidence, which clears the caches
            func.vmap(lambda r: r.index_fill(0, index, 5.0))(x)
    assert cpp_backend.size() >= 1
    registry.clear_cache()  # what a store write or a (un)registration calls
    assert cpp_backend.size() == 0


def test_cpp_native_decisions_do_not_call_python(cpp_backend) -> None:
    """A stored native decision runs without entering Python: no Python function runs inside the op's call."""
    x, index, source = torch.randn(3, 6, 4), torch.tensor([0, 2]), torch.randn(2, 4)
    fill = func.vmap(lambda r: r.index_add(0, index, source))
    with registry.use(pins={"index_add": "native"}, record=True) as run:
        fill(x)  # recording: the Python kernel decides, and counts
    assert run.calls == {"index_add": 1} and run.decisions[0].kind == "native"
    with registry.use(pins={"index_add": "native"}):
        stored = cpp_backend.size()
        fill(x)  # a miss: Python decides, the table stores it
        assert cpp_backend.size() == stored + 1
        seen: list[str] = []

        def profile(frame: object, event: str, arg: object) -> None:
            if event == "call":
                seen.append(frame.f_code.co_name)  # type: ignore[attr-defined]

        sys.setprofile(profile)
        try:
            torch.ops.aten.index_add.default(x[0], 0, index, source)  # eager: no kernel at all
            func.vmap(torch.ops.aten.index_add.default, in_dims=(0, None, None, None))(x, 0, index, source)
        finally:
            sys.setprofile(None)
    assert "decide" not in seen and not any(name.startswith("multicomposite_") for name in seen)
    assert cpp_backend.size() == stored + 1  # the vmapped call was a hit: nothing decided, nothing stored
