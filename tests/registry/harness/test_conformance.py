"""The conformance suite: its fast subset over every covered op (no check that passes natively fails inside use()),
every sample of the ops whose edge shapes broke inside use(), and a composite broken on purpose that it must catch."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import registry
from registry.core import selector
from registry.core.registration import COMPOSITES
from registry.harness import conformance, survey
from registry.store.conformance import conformance_rows, write_conformance
from registry.store.db import Store
from service.cli import main
from tests import cases

# Entries whose degenerate samples (empty, 0-d, a target of one element, channels_last, a weight of no dimension)
# broke inside use() before their composites declined those shapes: op -> samples checked in float64 (0: every
# sample; batch_norm's first 8 hold its empty input, #3, and take a quarter of its minute).
EDGE_OPS = {"batch_norm": 8, "take": 0, "multi_margin_loss": 0, "soft_margin_loss": 0, "chalf": 0, "fft_ihfft2": 0,
            "histogram": 0}
FAST_SAMPLES = cases.samples(2)  # every sample under make test-all


def _newly_failing(rows: list[conformance.ConformanceRow]) -> list[str]:
    return [f"{r.entry} {r.check} {r.dtype}: {r.detail}" for r in rows if r.newly_failing]


def test_no_check_that_passes_natively_fails_inside_use_on_the_first_samples_of_every_covered_op() -> None:
    jobs = conformance.covered_entries()
    checks = tuple(check for check in conformance.ALL_CHECKS if check not in conformance.DEPTH3_CHECKS)
    run = conformance.run_conformance(jobs, ["float32"], conformance.ConformanceConfig(
        checks=checks, sample_limit=FAST_SAMPLES), workers=2)
    assert _newly_failing(run.rows) == []
    summary = conformance.totals(run.rows)
    # Every entry with float32 samples (bincount's op_db entry has integer samples only).
    assert summary["entries"] == len({survey.entry_id(entry) for _, entry in jobs
                                      if torch.float32 in entry.supported_dtypes("cpu")})
    for check in checks:
        if check != conformance.NO_FALLBACK:
            assert summary["per_check"][check]["cases"] > 0, check
    assert summary["overall"]["newly_passing"] > 0  # what use() fixes: native's loops and errors


# The depth-3 checks (an inner gradient: grad(vmap(grad)), vmap(grad(grad)), jacrev(vmap(grad))) on a sample: the
# first sample of the normalization and pooling ops with a double backward, in float64. Every case: `multicomposite
# conformance --check 'vjp(vmap(vjp))' ...` (the full run's options).
DEPTH3_OPS = ("batch_norm", "instance_norm", "max_unpool2d")


def test_no_depth3_check_that_passes_natively_fails_inside_use_on_a_sample() -> None:
    run = conformance.run_conformance(conformance.covered_entries(DEPTH3_OPS), ["float64"],
                                      conformance.ConformanceConfig(checks=conformance.DEPTH3_CHECKS,
                                                                                    sample_limit=cases.samples(1)))
    assert _newly_failing(run.rows) == []
    summary = conformance.totals(run.rows)
    for check in conformance.DEPTH3_CHECKS:
        assert summary["per_check"][check]["cases"] > 0, check


@pytest.mark.parametrize("op", EDGE_OPS)
def test_the_samples_of_an_op_with_edge_shapes_conform(op: str) -> None:
    run = conformance.run_conformance(conformance.covered_entries([op]), ["float64"],
                                      conformance.ConformanceConfig(sample_limit=EDGE_OPS[op]))
    assert _newly_failing(run.rows) == []
    assert sum(r.degenerate_cases for r in run.rows) > 0


# --- the suite can fail -------------------------------------------------------------------------------------------


@pytest.fixture
def take_breaks_on_empty_inputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """take's composite as it was: indexing an empty self fails to broadcast, and an empty index batched last
    comes back transposed."""
    def old_take(self: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.reshape(-1)[index]

    composite = COMPOSITES["take"]["functional"]
    monkeypatch.setitem(COMPOSITES["take"], "functional", dataclasses.replace(composite, fn=old_take))
    selector.clear_cache()
    yield
    monkeypatch.undo()
    selector.clear_cache()


def test_a_composite_that_breaks_an_empty_input_is_caught(take_breaks_on_empty_inputs: None) -> None:
    run = conformance.run_conformance(conformance.covered_entries(["take"]), ["float64"],
                                      conformance.ConformanceConfig(checks=("vmap",)))
    (row,) = run.rows
    assert row.newly_failing > 0
    assert row.detail.startswith("#6 vmap in_dims=-1 on leaves 1: native slow")
    assert "use() mismatch output[0]: shape (0, 2) != (2, 0)" in row.detail


def _verdict(check: str, native: str, used: str) -> conformance.Verdict:
    return conformance.Verdict(check, 0, "input", survey.Outcome(native, f"native {native}"),
                               survey.Outcome(used, f"use {used}"))


def test_counts_separate_values_from_the_fallback_warning() -> None:
    (entry,) = survey.select_entries(survey.op_db(), ["take"])
    sample = next(iter(entry.sample_inputs("cpu", torch.float32)))
    verdicts = [_verdict("vmap", "slow", "ok"), _verdict("vmap", "ok", "mismatch"), _verdict("vmap", "error", "ok"),
                _verdict("vmap", "unsupported", "error"), _verdict("vjp", "ok", "ok")]
    rows = {r.check: r for r in conformance.rows_of("take", entry, "float32", verdicts, [sample],
                                                     ("vmap", "vjp", conformance.NO_FALLBACK))}
    vmap = rows["vmap"]
    # unsupported natively counts for neither side; slow is a pass of the values
    assert (vmap.cases, vmap.native_passed, vmap.use_passed, vmap.newly_passing, vmap.newly_failing) == (3, 2, 2, 1, 1)
    assert vmap.detail == "#0 vmap input: native ok native ok; use() mismatch use mismatch"
    warning = rows[conformance.NO_FALLBACK]
    # judged where both sides got the values right: slow -> ok is newly passing
    assert (warning.cases, warning.native_passed, warning.use_passed, warning.newly_passing) == (1, 0, 1, 1)
    assert (rows["vjp"].cases, rows["vjp"].newly_failing) == (1, 0)


def test_unknown_ops_and_checks_are_refused() -> None:
    with pytest.raises(conformance.ConformanceError, match="not covered ops: nope; list the covered ops"):
        conformance.covered_entries(["nope"])
    with pytest.raises(conformance.ConformanceError, match="unknown checks hessian; valid: vjp, jvp, vmap"):
        conformance.parse_checks(["hessian"])


# --- the command and the store -----------------------------------------------------------------------------------


def test_the_command_stores_rows_and_exits_zero(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    code = main(["conformance", "--op", "take", "--dtype", "float64", "--check", "vmap", "--check", "vjp",
                 "--workers", "0", "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["totals"]["overall"]["newly_failing"] == 0
    store = Store(url)
    try:
        stored = conformance_rows(store, torch_version=torch.__version__, op="take")
        assert [(r["entry"], r["check"], r["dtype"]) for r in stored] == [("take", "vjp", "float64"),
                                                                          ("take", "vmap", "float64")]
        assert stored[1]["cases"] == next(r["cases"] for r in printed["rows"] if r["check"] == "vmap") > 0
        # a later run replaces the row with the same key
        write_conformance(store, [{**stored[0], "cases": 1, "native_passed": 1, "use_passed": 1}])
        assert conformance_rows(store, op="take")[0]["cases"] == 1
        with pytest.raises(ValueError, match="cases must be counts"):
            write_conformance(store, [{**stored[0], "cases": -1}])
    finally:
        store.close()


def test_the_command_says_what_to_fix_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--op", "nope"]) == 2
    err = capsys.readouterr().err
    assert err == (f"multicomposite conformance: argument --op: unknown op 'nope'. {len(registry.OPS)} ops are "
                   "covered: list them with `multicomposite ops` or GET /ops (see multicomposite conformance --help)\n")
