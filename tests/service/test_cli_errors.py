"""Defects 9 and 10: usage errors are one line on stderr with exit code 2, never a traceback; misconfiguration is
refused at start in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import registry
from service.cli import main
from service.settings import Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("argv", "line"), [
    ("verify --dtype float33",
     "multicomposite verify: argument --dtype: unknown dtype 'float33'; choose from float32, float64, float16, "
     "bfloat16 (see multicomposite verify --help)"),
    ("profile --batch -1",
     "multicomposite profile: argument --batch: '-1' is not a positive whole number (see multicomposite profile "
     "--help)"),
    ("profile --device tpu",
     "multicomposite profile: argument --device: device 'tpu' is not available here; devices: cpu (a type, "
     "optionally with an index: cuda:0) (see multicomposite profile --help)"),
    ("verify --op nope",
     f"multicomposite verify: argument --op: unknown op 'nope'. {len(registry.OPS)} ops are covered: list them "
     "with `multicomposite ops` or GET /ops (see multicomposite verify --help)"),
    ("matrix --png /nonexistent/dir/m.png",
     "multicomposite matrix: argument --png: the folder /nonexistent/dir does not exist; create it, or write the "
     "PNG elsewhere (see multicomposite matrix --help)"),
    ("verify --stack vmap(grad",
     "multicomposite verify: argument --stack: unbalanced or mixed stack 'vmap(grad': write it nested, vmap(grad), "
     "or as a list, vmap,grad (see multicomposite verify --help)"),
    # The command's own --help is the one to read (argparse named the top level's).
    ("verify --workers 2",
     "multicomposite verify: unrecognized arguments: --workers 2 (see multicomposite verify --help)"),
    ("select index_fill --dtype _inductor",
     "multicomposite select: argument --dtype: unknown dtype '_inductor'; use a torch dtype name such as float32, "
     "float64, float16, bfloat16, int64, int32, bool, complex64 (see multicomposite select --help)"),
])
def test_usage_errors_are_one_line_and_exit_2(argv: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "--device tpu" in argv:
        import torch

        if torch.cuda.is_available():
            line = line.replace("devices: cpu", "devices: cpu, cuda")
    assert main(argv.split()) == 2
    assert capsys.readouterr().err == line + "\n"
    assert not Path("/nonexistent/dir").exists()


def _serve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", "18199"], cwd=ROOT, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.parametrize(("env", "line"), [
    ({"MULTICOMPOSITE_TOKEN": ""},
     "multicomposite serve: MULTICOMPOSITE_TOKEN='': is set but empty; set a secret, or unset it to serve without "
     "auth"),
    ({"MULTICOMPOSITE_QUEUE_SIZE": "abc"},
     "multicomposite serve: MULTICOMPOSITE_QUEUE_SIZE='abc': Input should be a valid integer, unable to parse string "
     "as an integer"),
    ({"MULTICOMPOSITE_DB": "sqlite:////nonexistent/dir/x.db"},
     "multicomposite serve: the store at sqlite:////nonexistent/dir/x.db cannot be opened: OperationalError: "
     "(sqlite3.OperationalError) unable to open database file"),
])
def test_misconfiguration_is_refused_at_start_in_one_line(env: dict[str, str], line: str) -> None:
    result = _serve(env)
    assert (result.returncode, result.stderr) == (2, line + "\n")


def test_unknown_setting_names_and_empty_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTICOMPOSITE_QUEUESIZE", "3")
    with pytest.raises(SettingsError, match="^MULTICOMPOSITE_QUEUESIZE is not a setting; the service's settings are "
                                            "MULTICOMPOSITE_CACHE_BYTES, MULTICOMPOSITE_CACHE_SIZE, "):
        load_settings()
    monkeypatch.delenv("MULTICOMPOSITE_QUEUESIZE")
    monkeypatch.setenv("MULTICOMPOSITE_TOKEN", "  ")
    with pytest.raises(SettingsError, match="^MULTICOMPOSITE_TOKEN='  ': is set but empty"):
        load_settings()
    with pytest.raises(ValueError, match="is set but empty"):
        Settings(token="")  # defect 9: an empty token silently disabled auth


# --- issue 20, part 5: the command line never shows a traceback ------------------------------------------------------


@pytest.mark.parametrize(("argv", "line"), [
    # The API's bound (service.limits.MAX_BATCH), applied before anything is allocated: was a 29-line traceback.
    ("profile --batch 100000000000",
     "multicomposite profile: argument --batch: batch size 100000000000 is over the limit of 1024 (the same bound "
     "as the API's MULTICOMPOSITE_MAX_BATCH default) (see multicomposite profile --help)"),
    ("survey --workers -3",
     "multicomposite survey: argument --workers: '-3' is not a whole number of at least 0 (see multicomposite survey "
     "--help)"),
    # The option given is the one blamed (was: MULTICOMPOSITE_PORT).
    ("serve --port 99999",
     "multicomposite serve: argument --port: '99999' is not a TCP port: use 1..65535 (see multicomposite serve "
     "--help)"),
])
def test_out_of_bounds_options_are_one_line(argv: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv.split()) == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_port_in_use_is_one_line_before_the_app_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    monkeypatch.setenv("MULTICOMPOSITE_DB", f"sqlite:///{tmp_path / 's.db'}")
    started: list[object] = []
    monkeypatch.setattr("service.main.create_app", lambda *a, **k: started.append(a))  # must not be reached
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (f"multicomposite serve: port {port} on 127.0.0.1 is in use (another server?); "
                                       "stop it, or choose another port with --port\n")
    assert started == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    import torch

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"multicomposite {version('multicomposite')} (torch {torch.__version__})\n"
    assert registry.__version__ == version("multicomposite")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_help_loads_neither_torch_nor_the_service() -> None:
    # --help took 4 s: every command's module, torch and the registry were imported to build the parser.
    result = _python("import sys\nfrom service.cli import main\ncode = main(['--help'])\n"
                     "print(code, sorted(m for m in ('torch', 'composites', 'registry.core.selector', 'fastapi', "
                     "'sqlalchemy', 'service.main') "
                     "if m in sys.modules))")
    assert result.stdout.splitlines()[-1] == "0 []", result.stderr[-2000:]
    assert "Verify, profile and choose among the decompositions of each PyTorch op under torch.func transforms" in \
        " ".join(result.stdout.split())  # says what the tool does


def test_every_commands_help_loads_neither_torch_nor_the_store() -> None:
    # `select`, `matrix`, `jobs` and `worker --help` took 1.5 s: their choices came from the registry (torch). They
    # still do, from its torch-free leaf modules (test_cli_choices.py).
    from service.cli import SUBCOMMANDS

    names = [command.name for command in SUBCOMMANDS]
    result = _python("import sys\nfrom service.cli import main\n"
                     f"codes = [main([name, '--help']) for name in {names!r}]\n"
                     "print(set(codes), sorted(m for m in ('torch', 'composites', 'registry.core.selector', "
                     "'sqlalchemy', 'fastapi', "
                     "'procrastinate') if m in sys.modules))")
    assert result.stdout.splitlines()[-1] == "{0} []", result.stderr[-2000:]


def test_a_closed_stdout_is_no_traceback(tmp_path: Path) -> None:
    # `multicomposite ops | head -5` ended in a BrokenPipeError traceback. The reader here is gone before the
    # command writes its first line.
    process = subprocess.Popen([sys.executable, "-m", "service.cli", "ops"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT),
                                    "MULTICOMPOSITE_DB": f"sqlite:///{tmp_path / 's.db'}"})
    assert process.stdout is not None
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (141, "")


def test_ctrl_c_during_verify_stops_the_workers_in_one_line(tmp_path: Path) -> None:
    # Was four tracebacks (the parent's and each forked worker's), then a hang until a second Ctrl-C.
    import signal

    process = subprocess.Popen([sys.executable, "-m", "service.cli", "verify", "--op", "index_fill", "--dtype",
                                "float32"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True,  # its own process group, as a terminal's foreground job
                               # Ctrl-C's default, as in a terminal: an ignored SIGINT is inherited through exec, and
                               # Python keeps ignoring it (the suite's process may have come to ignore it).
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                               env={**os.environ, "PYTHONPATH": str(ROOT),
                                    "MULTICOMPOSITE_DB": f"sqlite:///{tmp_path / 's.db'}"})
    assert process.stderr is not None
    try:
        first = process.stderr.readline()  # the first entry is done: the workers are running
        assert first.startswith("multicomposite verify: entries 1/"), first
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group gets it
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (process.returncode, stderr) == (130, "\nmulticomposite verify: interrupted; nothing of this run was "
                                                 "stored\n")
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)  # no worker is left behind
