"""``multicomposite build-kernels``: builds (or finds) the routing kernels; without a compiler, one line and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.core import kernels
from service.cli import main


def test_build_kernels_prints_where_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        expected = kernels.build_kernels(quiet=True)
    except kernels.KernelBuildError as error:
        pytest.skip(f"no C++ build here: {error}")
    assert main(["build-kernels"]) == 0
    assert capsys.readouterr().out == f"routing kernels: {expected}\n"


def test_build_kernels_without_a_compiler_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert main(["build-kernels"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("multicomposite build-kernels: no C++ compiler found")
    assert "apt-get install g++ nlohmann-json3-dev" in line
