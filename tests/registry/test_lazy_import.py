"""``import registry`` imports no torch and no composite family; the first call that needs the ops loads the
families (and the plugins) then. Checked in a fresh interpreter each (this one has loaded everything), by the names
in ``sys.modules`` and the size of the op table against an explicit ``registry.load()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from registry.core.registration import OpTable, RegistrationError

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, sys
    import registry
    after_import = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "composites"))
    {call}
    from registry.core.ops import OPS
    print(json.dumps({{"after_import": after_import, "ops": len(OPS), "families": "composites" in sys.modules}}))
""")

# Each public entry point that needs the ops, as a statement run first thing after ``import registry``.
FIRST_CALLS = {
    "load": "registry.load()",
    "select": "registry.select('index_fill', stack='vmap,grad')",
    "use": "with registry.use(): pass",
    "composites": "registry.composites('index_fill')",
    "OPS": "assert 'index_fill' in registry.OPS",
    "decomposition_table": "registry.decomposition_table('vmap', ops=['index_fill'])",
    "DEFAULT.ops": "assert registry.DEFAULT.ops",
}


def _probe(call: str, tmp_path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": f"sqlite:///{tmp_path / 'store.db'}"}
    result = subprocess.run([sys.executable, "-c", PROBE.format(call=call)], cwd=ROOT, text=True, capture_output=True,
                            timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("entry", list(FIRST_CALLS))
def test_the_first_call_that_needs_the_ops_loads_the_families(entry: str, tmp_path: Path) -> None:
    import registry

    probe = _probe(FIRST_CALLS[entry], tmp_path)
    assert probe == {"after_import": [], "ops": len(registry.OPS), "families": True}


def test_importing_the_core_alone_loads_no_family(tmp_path: Path) -> None:
    probe = _probe("import registry.core.selector", tmp_path)
    assert probe == {"after_import": [], "ops": 0, "families": False}


@pytest.fixture
def family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module standing for a built-in family, importable from ``tmp_path``: it counts its imports and asks the
    table to load again from inside its own import."""
    name = f"mc_lazy_family_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import builtins
        builtins.MC_LAZY_IMPORTS = getattr(builtins, "MC_LAZY_IMPORTS", 0) + 1
        TABLE.load()  # reentrant: returns at once on the loading thread
        if FAIL:
            raise RuntimeError("this family fails to import")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _table_for(name: str, fail: bool) -> OpTable:
    import builtins

    table = OpTable(builtins=(name,))
    builtins.TABLE, builtins.FAIL = table, fail  # what the family module reads
    return table


def test_a_table_loads_its_builtins_once(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    monkeypatch.setattr(builtins, "MC_LAZY_IMPORTS", 0, raising=False)
    table = _table_for(family, fail=False)
    try:
        assert family not in sys.modules
        table.load()
        table.load()
        assert (builtins.MC_LAZY_IMPORTS, table.loaded, table.loading) == (1, True, False)
    finally:
        del builtins.TABLE, builtins.FAIL


def test_a_family_that_fails_to_import_is_raised_and_tried_again(family: str) -> None:
    import builtins

    table = _table_for(family, fail=True)
    try:
        with pytest.raises(RuntimeError, match="fails to import"):
            table.load()
        assert (table.loaded, table.loading) == (False, False)
        builtins.FAIL = False
        table.load()
        assert table.loaded
    finally:
        del builtins.TABLE, builtins.FAIL


def test_register_of_an_op_no_family_defines_still_says_so() -> None:
    table = OpTable()
    with pytest.raises(RegistrationError, match="unknown op 'no_such_op'"):
        table.register("no_such_op", "functional")
    assert table.loaded  # it looked in the families first
