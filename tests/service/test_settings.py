"""The environment's MULTICOMPOSITE_* names: the service's settings and the library's variables are accepted, a name
nothing reads is refused in one line, by `serve` and by the commands that open the store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.cli import main
from service.settings import LIBRARY_VARIABLES, PREFIX, Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"MULTICOMPOSITE_[A-Z][A-Z_]*[A-Z]")


def _names_read_by(package: str) -> set[str]:
    return {name for path in (ROOT / package).rglob("*.py") for name in NAME.findall(path.read_text())}


def test_every_name_the_sources_read_is_a_setting_or_a_library_variable() -> None:
    service_settings = {PREFIX + field.upper() for field in Settings.model_fields}
    read = _names_read_by("registry") | _names_read_by("composites") | _names_read_by("service")
    assert read - service_settings - set(LIBRARY_VARIABLES) == set()
    assert set(LIBRARY_VARIABLES) <= _names_read_by("registry") | _names_read_by("composites")  # none stale


@pytest.mark.parametrize("name", sorted(LIBRARY_VARIABLES))
def test_the_librarys_variables_do_not_stop_the_service(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # MULTICOMPOSITE_ROUTING=python multicomposite serve was refused: "is not a setting".
    monkeypatch.setenv(name, "python" if name.endswith("ROUTING") else "x")
    assert load_settings().port == 8000


def test_a_misspelt_store_variable_is_refused_before_a_command_reads_the_default_store(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # MULTICOMPOSITE_STORE=... multicomposite matrix read the default store and said nothing.
    monkeypatch.setenv("MULTICOMPOSITE_STORE", "sqlite:////tmp/elsewhere.db")
    with pytest.raises(SettingsError, match="^MULTICOMPOSITE_STORE is not a setting"):
        load_settings()
    assert main(["matrix"]) == 2
    line = capsys.readouterr().err
    assert line.startswith("multicomposite matrix: MULTICOMPOSITE_STORE is not a setting; the service's settings are "
                           "MULTICOMPOSITE_CACHE_BYTES, ")
    assert line.count("\n") == 1 and "the library's are MULTICOMPOSITE_FUSED, " in line
