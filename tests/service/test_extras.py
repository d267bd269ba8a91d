"""A command whose extra is not installed says which extra, in one line, and exits 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from service.extras import command_of, extra_for, missing_extra_line


def test_each_library_names_its_extra() -> None:
    assert extra_for(ModuleNotFoundError("No module named 'sqlalchemy.orm'", name="sqlalchemy.orm")) == "service"
    assert extra_for(ModuleNotFoundError("x", name="psycopg")) == "postgres"
    assert extra_for(ModuleNotFoundError("x", name="procrastinate")) == "workers"
    assert extra_for(ModuleNotFoundError("x", name="matplotlib.figure")) == "plots"
    assert extra_for(ModuleNotFoundError("x", name="not_a_library_of_ours")) is None


def test_the_line_names_the_command_and_how_to_install() -> None:
    error = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    assert command_of(["--json", "matrix", "--png", "out.png"]) == "matrix"
    assert missing_extra_line(error, ["matrix", "--png", "out.png"]) == (
        "multicomposite matrix needs the 'plots' extra (matplotlib is not installed): "
        "pip install 'multicomposite[plots]' torch==2.13.0")
    assert missing_extra_line(ModuleNotFoundError("x", name="nothing_known"), ["ops"]) is None


EVERY_EXTRA = ("sqlalchemy", "alembic", "fastapi", "fastapi_offline", "uvicorn", "pydantic", "pydantic_settings",
               "prometheus_client", "rich", "psycopg", "procrastinate", "matplotlib")


def _cli_without(modules: str | tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    # ``sys.modules[name] = None`` makes ``import name`` raise ModuleNotFoundError, as if it were not installed.
    script = textwrap.dedent(f"""
        import sys
        for name in {(modules,) if isinstance(modules, str) else modules!r}:
            sys.modules[name] = None
        from service.cli import main
        sys.exit(main({list(argv)!r}))
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "argv", "extra"), [
    ("sqlalchemy", ("matrix",), "service"),
    ("sqlalchemy", ("worker",), "service"),  # its --help answers without the extra (test_cli_errors)
    ("uvicorn", ("serve",), "service"),
])
def test_a_missing_extra_is_one_line_and_exit_2(module: str, argv: tuple[str, ...], extra: str) -> None:
    finished = _cli_without(module, *argv)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr.splitlines() == [
        f"multicomposite {argv[0]} needs the {extra!r} extra ({module} is not installed): "
        f"pip install 'multicomposite[{extra}]' torch==2.13.0"]


def test_the_library_alone_lists_the_ops() -> None:
    finished = _cli_without(EVERY_EXTRA, "ops")
    assert finished.returncode == 0, finished.stderr
    assert "index_fill" in finished.stdout
