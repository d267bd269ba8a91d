"""The survey on a handful of op_db entries whose native behaviour is known, and on made-up ops that must fail it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.testing._internal.opinfo.core import SampleInput  # noqa: PLC2701 - the OpInfo database

from registry.harness import survey
from registry.store.db import Store
from registry.store.survey import survey_rows, write_survey
from service.cli import main

STATUS_KEY = tuple[str, str]  # (stack, batching)


@pytest.fixture(scope="module")
def database() -> list[Any]:
    return survey.op_db()


def statuses(rows: list[survey.SurveyRow], dtype: str = "float32") -> dict[STATUS_KEY, tuple[str, str]]:
    return {(r.stack, r.batching): (r.native_status, r.use_status) for r in rows if r.dtype == dtype}


FAST_SAMPLES = 2  # the unit tests' subset of an entry's samples (the survey's default is 25)


def run_entry(database: list[Any], name: str, dtype: str = "float32", **config: Any) -> list[survey.SurveyRow]:
    (entry,) = survey.select_entries(database, [name])
    return survey.survey_entry(entry, dtype, survey.SurveyConfig(**{"limit_samples": FAST_SAMPLES, **config}))


def test_add_is_ok_everywhere(database: list[Any]) -> None:
    rows = run_entry(database, "add")
    assert statuses(rows) == {(s, b): ("ok", "ok") for s in survey.SURVEY_STACKS for b in survey.BATCHINGS}
    assert all(r.samples == 2 for r in rows)
    assert {r.torch_version for r in rows} == {torch.__version__}


def test_masked_scatter_is_slow_under_vmap_natively_and_ok_inside_use(database: list[Any]) -> None:
    rows = run_entry(database, "masked_scatter")
    ok, slow = ("ok", "ok"), ("slow", "ok")
    assert statuses(rows) == {
        ("vmap", "input"): slow, ("grad", "input"): ok, ("vmap(grad)", "input"): slow, ("jacrev", "input"): ok,
        ("jacfwd", "input"): slow, ("vmap(jvp)", "input"): slow,
        ("vmap", "others"): slow, ("grad", "others"): ok, ("vmap(grad)", "others"): slow, ("jacrev", "others"): slow,
        ("jacfwd", "others"): slow, ("vmap(jvp)", "others"): slow,
    }
    vmap_row = next(r for r in rows if (r.stack, r.batching) == ("vmap", "input"))
    assert vmap_row.native_detail.startswith(
        "There is a performance drop because we have not yet implemented the batching rule for aten::masked_scatter.")
    jacrev_row = next(r for r in rows if (r.stack, r.batching) == ("jacrev", "others"))
    assert "aten::masked_scatter_backward." in jacrev_row.native_detail


def test_index_fill_with_a_batched_value_is_wrong_natively_and_ok_inside_use(database: list[Any]) -> None:
    rows = run_entry(database, "index_fill", "float64")
    ok = ("ok", "ok")
    assert statuses(rows, "float64") == {
        **{(s, "input"): ok for s in survey.SURVEY_STACKS},
        ("vmap", "others"): ("mismatch", "ok"), ("grad", "others"): ok, ("vmap(grad)", "others"): ("slow", "ok"),
        ("jacrev", "others"): ok, ("jacfwd", "others"): ok, ("vmap(jvp)", "others"): ("mismatch", "ok"),
    }
    vmap_row = next(r for r in rows if (r.stack, r.batching) == ("vmap", "others"))
    assert vmap_row.native_detail == "output[0]: max abs error 0.758, max rel error 0.1"
    assert vmap_row.max_abs_error == pytest.approx(0.758, abs=5e-4)
    assert vmap_row.use_detail == ""


def test_dynamic_shape_and_random_ops_are_unsupported_under_vmap(database: list[Any]) -> None:
    # Inside use() a dynamic-shape op runs per sample where the samples' shapes agree (else the batch splits).
    nonzero = statuses(run_entry(database, "nonzero", stacks=("vmap",), batchings=("input",)))
    assert nonzero == {("vmap", "input"): ("unsupported", "ok")}
    row = run_entry(database, "nonzero", stacks=("vmap",), batchings=("input",))[0]
    assert row.native_detail.startswith("dynamic shape op: RuntimeError: ")
    bernoulli = run_entry(database, "bernoulli", stacks=("vmap", "grad"), batchings=("input",))
    by_stack = {r.stack: r for r in bernoulli}
    assert by_stack["vmap"].native_status == "unsupported"
    assert by_stack["vmap"].native_detail.startswith(
        "random op (vmap randomness='error'): RuntimeError: vmap: called random operation while in randomness error "
        "mode.")
    # Outside vmap OpInfo seeds the op on every call: the transform and the reference are comparable, and agree.
    assert by_stack["grad"].native_status == "ok"


def test_unique_runs_per_sample_inside_use(database: list[Any]) -> None:
    # Natively vmap says "dynamic shape" (by design, not counted as a gap); inside use() each sample's unique runs
    # where the shapes agree, and a batch whose shapes differ splits (registry.core.batch_split).
    (row,) = run_entry(database, "unique", stacks=("vmap",), batchings=("input",))
    assert (row.native_status, row.use_status) == ("unsupported", "ok")
    assert row.native_detail.startswith("dynamic shape op: RuntimeError: vmap: We do not support batching operators ")


def test_an_unsupported_dtype_is_reported_for_every_row(database: list[Any]) -> None:
    (entry,) = [o for o in database if torch.float32 not in o.supported_dtypes("cpu")][:1]
    rows = survey.survey_entry(entry, "float32", survey.SurveyConfig(stacks=("vmap",), limit_samples=FAST_SAMPLES))
    assert [(r.native_status, r.native_detail) for r in rows] == [
        ("unsupported", "op does not support float32 on CPU")] * 2


# --- the harness must be able to fail --------------------------------------------------------------------------


class _SquareWrongJvp(torch.autograd.Function):
    """x * x with a correct backward and a forward-mode formula off by a factor 3."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 2 * x

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return tangent * 6 * x


def fake_entry(name: str, op: Callable[..., Any], **flags: Any) -> SimpleNamespace:
    """An OpInfo stand-in with one (3, 4) float sample."""

    def sample_inputs(device: str, dtype: torch.dtype, requires_grad: bool = False) -> list[SampleInput]:
        x = torch.linspace(-1.5, 2.0, 12, dtype=dtype).reshape(3, 4)
        return [SampleInput(x)]

    defaults = {"supports_autograd": True, "supports_forward_ad": True, "supports_gradgrad": True,
                "gradcheck_wrapper": lambda op, *args, **kwargs: op(*args, **kwargs)}
    return SimpleNamespace(name=name, variant_test_name="", op=op, sample_inputs=sample_inputs,
                           supported_dtypes=lambda device: {torch.float32, torch.float64}, **{**defaults, **flags})


def test_a_wrong_forward_mode_formula_is_a_mismatch_under_the_forward_stacks_only() -> None:
    entry = fake_entry("square_wrong_jvp", _SquareWrongJvp.apply)
    rows = survey.survey_entry(entry, "float64", survey.SurveyConfig(batchings=("input",), inside_use=False,
                                                                          limit_samples=FAST_SAMPLES))
    assert {r.stack: r.native_status for r in rows} == {
        "vmap": "ok", "grad": "ok", "vmap(grad)": "ok", "jacrev": "ok", "jacfwd": "mismatch", "vmap(jvp)": "mismatch",
    }
    by_stack = {r.stack: r for r in rows}
    assert by_stack["jacfwd"].native_detail.startswith("u^T J[0][0]: max abs error")
    assert by_stack["vmap(jvp)"].native_detail.startswith("output[1][0]: max abs error")
    assert {r.use_status for r in rows} == {"unsupported"}


def test_the_forward_ad_reference_is_used_without_double_backward() -> None:
    entry = fake_entry("square_wrong_jvp", _SquareWrongJvp.apply, supports_gradgrad=False)
    config = survey.SurveyConfig(stacks=("vmap(jvp)",), batchings=("input",), inside_use=False,
                                 limit_samples=FAST_SAMPLES)
    # forward_ad runs the same wrong formula as jvp: the reference agrees with it. Documented as the weaker check.
    assert survey.survey_entry(entry, "float64", config)[0].native_status == "ok"


def test_an_item_call_is_an_error_with_its_first_line() -> None:
    entry = fake_entry("scaled_by_first", lambda x: x * x.flatten()[0].item())
    rows = survey.survey_entry(entry, "float32", survey.SurveyConfig(stacks=("vmap",), batchings=("input",),
                                                                          limit_samples=FAST_SAMPLES))
    assert rows[0].native_status == "error"
    assert rows[0].native_detail == ("RuntimeError: vmap: It looks like you're calling .item() on a Tensor. We don't "
                                     "support vmap over calling .item() on a Tensor, please try to rewrite what "
                                     "you're doing with other operations. If error is occurring somewhere inside "
                                     "PyTorch internals, please file a bug report.")


def test_forked_workers_give_the_same_rows_and_survive_a_dying_worker(database: list[Any]) -> None:
    entries = [*survey.select_entries(database, ["add", "index_fill"]),
               fake_entry("exits", lambda x: os._exit(3))]
    config = survey.SurveyConfig(stacks=("vmap",), limit_samples=1)
    in_process = survey.run_survey(entries[:2], ["float32"], config)
    forked = survey.run_survey(entries, ["float32"], config, workers=2)
    as_keys = lambda run: {(r.op, r.stack, r.batching): (r.native_status, r.use_status) for r in run.rows}  # noqa: E731
    assert as_keys(forked) == {**as_keys(in_process), ("exits", "vmap", "input"): ("error", "error"),
                               ("exits", "vmap", "others"): ("error", "error")}
    died = [r for r in forked.rows if r.op == "exits"]
    assert {r.native_detail for r in died} == {"survey worker died (exit code 3)"}


def test_a_hung_job_is_killed_and_the_survey_goes_on(database: list[Any]) -> None:
    entries = [fake_entry("hangs", lambda x: time.sleep(60) or x), *survey.select_entries(database, ["add"])]
    config = survey.SurveyConfig(stacks=("vmap",), batchings=("input",), limit_samples=1, case_timeout_s=0)
    start = time.monotonic()
    run = survey.run_survey(entries, ["float32"], config, workers=1, job_timeout_s=3)
    assert time.monotonic() - start < 30
    assert [(r.op, r.native_status, r.native_detail) for r in run.rows] == [
        ("hangs", "error", "survey worker killed: the job took over 3 s"), ("add", "ok", "")]


# --- selection, summary, store and command line ----------------------------------------------------------------


def test_bad_names_say_what_is_valid(database: list[Any]) -> None:
    with pytest.raises(survey.SurveyError, match=r"^unknown op_db entry 'index_fil'; did you mean index_fill"):
        survey.select_entries(database, ["index_fil"])
    with pytest.raises(survey.SurveyError) as stack_error:
        survey.normalize_stack("hessian")
    assert str(stack_error.value) == ("unknown survey stack 'hessian'; valid: vmap, grad, vmap(grad), jacrev, jacfwd, "
                                      "vmap(jvp), grad(vmap(grad)), vmap(grad(grad)), jacrev(vmap(grad))")
    assert survey.normalize_stack("vmap,grad") == "vmap(grad)"
    assert [survey.entry_id(o) for o in survey.select_entries(database, ["scatter_reduce.prod"])] == [
        "scatter_reduce.prod"]
    assert len(survey.select_entries(database, ["scatter_reduce"])) > 1


def _row(**overrides: Any) -> survey.SurveyRow:
    values = {"op": "index_fill", "opinfo_name": "index_fill", "variant_test_name": "", "stack": "vmap",
              "batching": "others", "dtype": "float32", "native_status": "mismatch", "native_detail": "off",
              "use_status": "ok", "use_detail": "", "max_abs_error": 0.5, "max_rel_error": 0.1, "samples": 2,
              "torch_version": "2.13.0", "timestamp": "2026-11-30T17:00:00+00:00"}
    return survey.SurveyRow(**{**values, **overrides})


def test_summary_counts_entries_by_kind_and_stack() -> None:
    rows = [_row(), _row(stack="grad", native_status="error"), _row(op="add", native_status="ok"),
            _row(op="take", native_status="slow", use_status="slow", stack="vmap(grad)")]
    summary = survey.summarize(rows)
    assert summary["misbehaving_natively"] == 2
    assert summary["by_kind"] == {"slow": 1, "mismatch": 1, "error": 1}
    assert summary["by_stack"] == {"vmap": {"slow": 0, "mismatch": 1, "error": 0},
                                   "grad": {"slow": 0, "mismatch": 0, "error": 1},
                                   "vmap(grad)": {"slow": 1, "mismatch": 0, "error": 0}}
    assert summary["fixed_inside_use"] == ["index_fill"]
    assert [w["op"] for w in summary["worst"]] == ["index_fill", "take"]


def test_store_round_trip_and_upsert(store_url: str) -> None:
    store = Store(store_url)
    try:
        assert write_survey(store, [_row(), _row(stack="grad")]) == 2
        assert write_survey(store, [_row(native_status="ok", native_detail="")]) == 1
        stored = survey_rows(store, op="index_fill")
        assert [(r["stack"], r["native_status"]) for r in stored] == [("grad", "mismatch"), ("vmap", "ok")]
        with pytest.raises(ValueError) as error:
            write_survey(store, [_row(use_status="broken")])
        assert str(error.value) == ("invalid use_status 'broken' for survey row index_fill/vmap; valid: ok, slow, "
                                    "error, mismatch, unsupported")
    finally:
        store.close()


def test_cli_json_and_store(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["survey", "--op", "index_fill", "--stack", "vmap", "--dtype", "float64", "--workers", "0", "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert {(r["batching"], r["native_status"], r["use_status"]) for r in printed["rows"]} == {
        ("input", "ok", "ok"), ("others", "mismatch", "ok")}
    assert printed["summary"]["fixed_inside_use"] == ["index_fill"]
    store = Store()
    try:
        stored = survey_rows(store, op="index_fill", stack="vmap", torch_version=torch.__version__)
    finally:
        store.close()
    assert {(r["batching"], r["dtype"], r["native_status"]) for r in stored} >= {("others", "float64", "mismatch")}


def test_cli_table_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["survey", "--op", "add", "--stack", "vmap", "--dtype", "float32", "--workers", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["add", "ok/ok"]
    assert out[2].startswith("0 of 1 op_db entries misbehave natively")
    assert main(["survey", "--op", "no_such_op"]) == 2
    assert capsys.readouterr().err == ("multicomposite survey: unknown op_db entry 'no_such_op' (names are OpInfo "
                                       "names such as 'add' or 'scatter_reduce.prod')\n")
    assert main(["survey", "--stack", "vmap(vmap)"]) == 2
    assert "unknown survey stack 'vmap(vmap)'" in capsys.readouterr().err
    assert main(["survey", "--op", "add", "--limit-samples", "-1"]) == 2
    assert capsys.readouterr().err == ("multicomposite survey: --limit-samples must be 0 (every sample) or more, "
                                       "got -1\n")


def test_limit_zero_picks_every_sample_whatever_its_size(database: list[Any]) -> None:
    entry = next(e for e in database if survey.entry_id(e) == "nn.functional.max_unpool2d")
    every = list(entry.sample_inputs("cpu", torch.float32, requires_grad=False))
    assert len(survey.pick_samples(entry, torch.float32, survey.ALL_SAMPLES)) == len(every) > 2
    assert len(survey.pick_samples(entry, torch.float32, 2)) == 2
