"""``COMMAND --help`` lists the registry's own vocabularies (the policies, the statuses, the job states) and imports
no torch: the modules that define them are leaves that ``import registry`` does not make heavy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from registry.core.policies import POLICIES
from registry.core.selector import POLICIES as SELECTOR_POLICIES
from registry.core.status import STATUSES
from registry.store.job_states import JOB_STATES
from registry.store.job_store import ACTIVE_JOB_STATES, FINISHED_JOB_STATES

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import contextlib, io, json, sys
from service.cli import main
helps = {}
for name in ("select", "check", "matrix", "jobs"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([name, "--help"])
    helps[name] = [code, out.getvalue()]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "composites", "sqlalchemy")
               or m in ("registry.core.selector", "registry.store.db", "registry.store.job_store"))
print(json.dumps({"helps": helps, "heavy": heavy}))
"""


def _helps() -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, text=True, capture_output=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_help_lists_the_registrys_choices_without_torch() -> None:
    probe = _helps()
    assert probe["heavy"] == []
    helps = probe["helps"]
    assert isinstance(helps, dict)
    expected = {"select": ("--policy", POLICIES), "check": ("--policy", POLICIES),
                "matrix": ("--status", STATUSES), "jobs": ("--state", JOB_STATES)}
    for name, (option, choices) in expected.items():
        code, text = helps[name]
        assert code == 0, name
        assert f"{option} {{{','.join(choices)}}}" in text, (name, text)


def test_the_vocabularies_are_the_ones_their_users_read() -> None:
    # One definition each: the selector's and the store's names are the leaf modules' objects, not copies.
    assert SELECTOR_POLICIES is POLICIES
    assert set(ACTIVE_JOB_STATES) | set(FINISHED_JOB_STATES) | {"queued"} == set(JOB_STATES)
