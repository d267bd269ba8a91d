"""One compile of the routing kernels for many processes, nothing half-built ever loaded, and a first use() that
never waits for the compiler (issue 29.3).

The compiler is a stand-in (``$CXX``, a shell script): it counts its runs, waits, and writes the real extension
(copied from the suite's cache, same build id), so four processes or a background build finish in seconds, not in
four 80-second compiles."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from registry.core import kernels, routing

ROOT = Path(__file__).resolve().parents[3]

# Build in this process alone: the kernels' module loaded from its file (as the background build loads it), so
# that four of these start in a second (no registry, no composites).
BUILD = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("kernels_alone", sys.argv[1])
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    print(kernels.build_kernels(quiet=True), flush=True)
""")


@pytest.fixture(scope="module")
def real_extension() -> Path:
    try:
        return kernels.build_kernels(quiet=True)  # the suite's cache: built once
    except kernels.KernelBuildError as error:
        pytest.skip(f"no C++ build here: {error}")


def _stand_in(tmp_path: Path, real: Path, *, seconds: float, half: bool = False) -> Path:
    """A compiler that appends a line to ``runs``, waits ``seconds`` and writes the extension after ``-o`` (half of
    it first when ``half``: a compile killed there leaves a partial file)."""
    script = tmp_path / "c++"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo $$ >> {tmp_path / 'runs'}
        while [ "$1" != "-o" ]; do shift; done
        out="$2"
        {f'head -c 1000 {real} > "$out"' if half else ':'}
        sleep {seconds}
        cp {real} "$out"
    """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _runs(tmp_path: Path) -> int:
    runs = tmp_path / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def _env(tmp_path: Path, compiler: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, kernels.CACHE_ENV: str(tmp_path / "cache"), "CXX": str(compiler), "PYTHONPATH": str(ROOT),
            **extra}


def test_four_processes_starting_at_once_compile_once(tmp_path: Path, real_extension: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = _stand_in(tmp_path, real_extension, seconds=1.5)
    builders = [subprocess.Popen([sys.executable, "-c", BUILD, kernels.__file__], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=_env(tmp_path, compiler))
                for _ in range(4)]
    outputs = [builder.communicate(timeout=120) for builder in builders]
    assert [builder.returncode for builder in builders] == [0] * 4, [err for _, err in outputs]
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    expected = kernels.extension_path()
    assert {out.strip() for out, _ in outputs} == {str(expected)}
    assert _runs(tmp_path) == 1
    assert expected.read_bytes() == real_extension.read_bytes()
    assert not list((tmp_path / "cache").glob(".*")), "no temporary folder left"


def test_a_compile_killed_halfway_leaves_nothing_to_load(tmp_path: Path, real_extension: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    expected = kernels.extension_path()
    slow = _stand_in(tmp_path, real_extension, seconds=60, half=True)
    builder = subprocess.Popen([sys.executable, "-c", BUILD, kernels.__file__], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env(tmp_path, slow), start_new_session=True)
    deadline = time.monotonic() + 60
    while not [p for p in (tmp_path / "cache").glob(f".*/{expected.name}") if p.stat().st_size > 0]:
        assert time.monotonic() < deadline and builder.poll() is None, builder.stderr.read() if builder.stderr else ""
        time.sleep(0.05)
    os.killpg(builder.pid, signal.SIGKILL)  # the build and its compiler, halfway through writing
    builder.communicate()
    assert not expected.exists() and not expected.parent.exists()
    # The next process takes the lock the killed one held, clears its leftovers and builds whole.
    fast = _stand_in(tmp_path, real_extension, seconds=0)
    done = subprocess.run([sys.executable, "-c", BUILD, kernels.__file__], capture_output=True, text=True,
                          env=_env(tmp_path, fast), timeout=120)
    assert done.returncode == 0, done.stderr
    assert expected.read_bytes() == real_extension.read_bytes()
    assert not list((tmp_path / "cache").glob(".*")), "the killed build's temporary folder is gone"


# The first use() routes with the Python kernels at once, while the build runs; the program goes on, and switches
# to the C++ kernels at a use() entry once the build landed. Its results and decisions never change (ops without a
# C++ op of this package: where the build adds one, cached decisions are made again, tests/composites/test_cpp_ops).
SWITCH = textwrap.dedent("""
    import json, time, torch, registry
    from torch import func
    from registry.core import routing
    from registry.core.kernels import background
    torch.manual_seed(0)
    x, index, source = torch.randn(4, 6, 3), torch.tensor([0, 2]), torch.randn(2, 3)
    def program():
        per_sample = func.vmap(func.grad(lambda r: r.index_add(0, index, source).index_copy(0, index, -source).sum()))
        return per_sample(x)
    seen, results, decisions = [], [], []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with registry.use():
            results.append(program())
            seen.append(routing.routing_backend())
        decisions.append([registry.select(op, stack="vmap(grad)").composite for op in ("index_add", "index_copy")])
        if seen[-1] == "cpp" and seen.count("cpp") > 2:
            break
        time.sleep(0.05)
    print(json.dumps({"first": seen[0], "last": seen[-1], "switches": sum(a != b for a, b in zip(seen, seen[1:])),
                      "same_results": all(torch.equal(r, results[0]) for r in results),
                      "same_decisions": all(d == decisions[0] for d in decisions),
                      "started": background.BUILD.started}))
""")


def test_the_first_use_routes_at_once_and_switches_when_the_build_lands(tmp_path: Path,
                                                                         real_extension: Path) -> None:
    compiler = _stand_in(tmp_path, real_extension, seconds=3)
    done = subprocess.run([sys.executable, "-W", "always", "-c", SWITCH], capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path, compiler, **{routing.BACKEND_ENV: ""}))
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome == {"first": "python", "last": "cpp", "switches": 1, "same_results": True,
                       "same_decisions": True, "started": True}
    assert _runs(tmp_path) == 1
    assert "runs its Python routing kernels" not in done.stderr  # nothing failed: nothing to warn about


def test_cpp_waits_for_the_build(tmp_path: Path, real_extension: Path) -> None:
    """MULTICOMPOSITE_ROUTING=cpp: the first use() waits for the compile, and routes on the C++ kernels."""
    compiler = _stand_in(tmp_path, real_extension, seconds=1)
    script = ("import torch, registry\nfrom registry.core import routing\n"
              "with registry.use():\n    torch.func.vmap(torch.sin)(torch.randn(2, 3))\n"
              "print(routing.routing_backend())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=_env(tmp_path, compiler, **{routing.BACKEND_ENV: "cpp"}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["cpp"] and _runs(tmp_path) == 1


def test_the_build_id_follows_the_shared_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """functorch_levels.h is compiled into every kernel file that includes it: a change to it is a new build."""
    assert kernels.HEADERS and all(header.exists() for header in kernels.HEADERS)
    header = tmp_path / "functorch_levels.h"
    header.write_text(kernels.HEADERS[0].read_text())
    monkeypatch.setattr(kernels, "HEADERS", (header,))
    before = kernels.build_id()
    header.write_text(header.read_text() + "\n// changed\n")
    assert kernels.build_id() != before
