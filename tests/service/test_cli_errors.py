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
     "multicomposite verify: argument --op: unknown op 'nope'. Covered ops: {ops} (see multicomposite verify --help)"),
    ("matrix --png /nonexistent/dir/m.png",
     "multicomposite matrix: argument --png: the folder /nonexistent/dir does not exist; create it, or write the "
     "PNG elsewhere (see multicomposite matrix --help)"),
    ("verify --stack vmap(grad",
     "multicomposite verify: argument --stack: unbalanced or mixed stack 'vmap(grad': write it nested, vmap(grad), "
     "or as a list, vmap,grad (see multicomposite verify --help)"),
    ("select index_fill --dtype _inductor",
     "multicomposite select: argument --dtype: unknown dtype '_inductor'; use a torch dtype name such as float32, "
     "float64, float16, bfloat16, int64, int32, bool, complex64 (see multicomposite select --help)"),
])
def test_usage_errors_are_one_line_and_exit_2(argv: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "--device tpu" in argv:
        import torch

        if torch.cuda.is_available():
            line = line.replace("devices: cpu", "devices: cpu, cuda")
    line = line.replace("{ops}", ", ".join(registry.OPS))  # every covered op, in definition order
    with pytest.raises(SystemExit) as exited:
        main(argv.split())
    assert exited.value.code == 2
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
    with pytest.raises(SettingsError, match="^MULTICOMPOSITE_QUEUESIZE is not a setting; settings are "
                                            "MULTICOMPOSITE_CACHE_BYTES, MULTICOMPOSITE_CACHE_SIZE, "):
        load_settings()
    monkeypatch.delenv("MULTICOMPOSITE_QUEUESIZE")
    monkeypatch.setenv("MULTICOMPOSITE_TOKEN", "  ")
    with pytest.raises(SettingsError, match="^MULTICOMPOSITE_TOKEN='  ': is set but empty"):
        load_settings()
    with pytest.raises(ValueError, match="is set but empty"):
        Settings(token="")  # defect 9: an empty token silently disabled auth
