"""The command line on a seeded store: exact plain lines (no escape codes) off a terminal, one JSON document from
every read command's --json, help on every option, matrix --failing, progress on stderr."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import registry
from registry.core import kernels
from registry.core.selector import covered_ops
from registry.core.sources import source_hashes
from registry.store import evidence
from registry.store.choices import native_failures
from registry.store.db import Store
from registry.store.records import JobRecord, MatrixEntry, ProfileEntry
from registry.store.survey import write_survey
from service import cli_output
from service.cli import SUBCOMMANDS, build_parser, main

# The shipped reference profiles rank the C++ op of the fused ops first, where it is built (make test builds it).
FASTEST_FUSED = "cpp_op" if kernels.fused_ops_available() else "primitive"

TORCH = torch.__version__


def _cell(op: str, composite: str, stack: tuple[str, ...], pattern: str, status: str, detail: str = "",
          max_abs: float | None = None) -> MatrixEntry:
    return MatrixEntry(op=op, composite=composite, kind=composite, stack=stack, pattern=pattern, dtype="float32",
                       status=status, detail=detail, max_abs_error=max_abs, max_rel_error=None,
                       source_hash=source_hashes()[(op, composite)], torch_version=TORCH, device="cpu")


def _timing(op: str, composite: str, median: float | None, iqr: float | None, *, batch: int = 256,
            detail: str = "") -> ProfileEntry:
    return ProfileEntry(op=op, composite=composite, kind=composite, stack=("vmap",), workload="vmap",
                        dtype="float32", device="cpu", device_name="cpu", numel_bucket=1024, batch_size=batch,
                        valid=median is not None, detail=detail, median_us=median, iqr_us=iqr,
                        runs=50 if median is not None else 0, peak_memory=None,
                        source_hash=source_hashes()[(op, composite)], torch_version=TORCH)


MATRIX = [
    _cell("index_fill", "native", ("vmap",), "others", "mismatch", "tensor-negdim: max abs error 3.52", 3.52),
    _cell("index_fill", "native", ("vmap",), "self", "ok"),
    _cell("index_fill", "functional", ("vmap",), "others", "ok"),
    _cell("index_fill", "functional", ("vmap",), "self", "ok"),
    _cell("masked_fill", "native", ("vmap",), "all", "slow", "aten::masked_fill.Tensor has no batching rule"),
    _cell("masked_fill", "functional", ("vmap",), "all", "ok"),
    _cell("masked_fill", "primitive", ("vmap",), "all", "error", "RuntimeError: boom"),
    _cell("masked_fill", "native", ("vmap", "grad"), "all", "slow", "aten::masked_fill.Tensor has no batching rule"),
]
PROFILES = [
    _timing("masked_fill", "native", 400.0, 40.0),
    _timing("masked_fill", "functional", 200.0, 20.0),
    _timing("masked_fill", "primitive", 100.0, 10.0),  # fast, but the matrix says it errs here
    _timing("masked_fill", "mutating", None, None, detail="RuntimeError: vmap: inplace arithmetic"),
    _timing("masked_fill", "functional", 1.0, 0.0, batch=32),  # not the largest batch: not in the report
]
JOB = JobRecord(id="job-1", kind="verify", params={"ops": ["index_fill"]}, state="done", done=3, total=3,
                result={"entries": 3}, owner="host:1", created_at=0.0, started_at=1.0, finished_at=61.0,
                updated_at=61.0)
SURVEY_ROW = {"torch_version": TORCH, "op": "index_fill", "opinfo_name": "index_fill", "variant_test_name": "",
              "stack": "vmap", "batching": "others", "dtype": "float32", "native_status": "mismatch",
              "native_detail": "max abs error 2.5", "use_status": "ok", "use_detail": "", "max_abs_error": 2.5,
              "max_rel_error": 1.0, "samples": 2, "timestamp": "2026-11-30T20:00:00Z"}


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A store of its own, holding MATRIX, PROFILES, JOB and SURVEY_ROW; the CLI's default store for the test."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    with Store(url) as store:
        store.write_entries(MATRIX)
        store.write_profiles(PROFILES)
        store.add_job(JOB)
        write_survey(store, [SURVEY_ROW])
    evidence.use_loader(None)
    evidence.use_profile_loader(None)
    yield url


@pytest.fixture
def empty_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    Store(url).close()
    return url


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err, "escape codes off a terminal"
    return code, captured.out, captured.err


# --- the parser ------------------------------------------------------------------------------------------------------


def _actions(parser: argparse.ArgumentParser, prog: str = "multicomposite") -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{prog} {choice.dest}", choice
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{prog} {name}")
        yield prog, action


def test_every_option_and_command_has_help() -> None:
    missing = [f"{where} {action.dest}" for where, action in _actions(build_parser())
               if not action.help or action.help == argparse.SUPPRESS]
    assert missing == []
    assert len(list(_actions(build_parser()))) > 50  # the walk reached every subcommand's options


def test_every_read_command_takes_json() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    reads = [c.name for c in SUBCOMMANDS if c.reads]
    assert reads == ["ops", "select", "matrix", "profiles", "report", "survey-results", "jobs"]
    for name in reads:
        assert "--json" in sub.choices[name]._option_string_actions, name
    assert list(sub.choices) == [c.name for c in SUBCOMMANDS]


# Positional arguments some read commands need; a new read command without one needs no entry here.
READ_ARGS = {"select": ["index_fill", "--stack", "vmap", "--batched", "value"]}


@pytest.mark.parametrize("command", [c.name for c in SUBCOMMANDS if c.reads])
def test_json_is_one_document_on_stdout_and_nothing_else(command: str, seeded: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _run([command, *READ_ARGS.get(command, []), "--json"], capsys)
    assert (code, stderr) == (0, "")
    json.loads(stdout)  # one document: anything printed beside it would fail here
    assert stdout.endswith("}\n") or stdout.endswith("]\n")


# --- read commands: exact lines and JSON -----------------------------------------------------------------------------


def test_matrix_lists_entries_in_a_plain_table(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = _run(["matrix", "--op", "masked_fill", "--stack", "vmap"], capsys)
    assert code == 0
    assert stdout.splitlines() == [
        "op           composite   stack  pattern  dtype    status  detail",
        "masked_fill  functional  vmap   all      float32  ok",
        "masked_fill  native      vmap   all      float32  slow    aten::masked_fill.Tensor has no batching rule",
        "masked_fill  primitive   vmap   all      float32  error   RuntimeError: boom",
    ]
    code, stdout, _ = _run(["matrix", "--status", "mismatch", "--json"], capsys)
    assert json.loads(stdout) == [{
        "op": "index_fill", "composite": "native", "kind": "native", "stack": "vmap", "pattern": "others",
        "dtype": "float32", "status": "mismatch", "detail": "tensor-negdim: max abs error 3.52",
        "max_abs_error": 3.52, "max_rel_error": None, "source_hash": source_hashes()[("index_fill", "native")],
        "torch_version": TORCH, "device": "cpu", "measured_at": None}]  # the test's seeded entries carry no time


def _reason(op: str, stack: str, batched: tuple[str, ...]) -> str:
    """The selector's own reason on the seeded evidence: the CLI must report exactly it."""
    evidence.set_entries(MATRIX)
    evidence.set_profiles(PROFILES)
    try:
        return registry.select(op, stack=stack, batched=batched, dtype="float32").reason
    finally:
        evidence.use_loader(None)
        evidence.use_profile_loader(None)


def test_matrix_failing_lists_natives_failures_and_the_choice_in_each(
        seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _run(["matrix", "--failing", "--json"], capsys)
    assert (code, stderr) == (0, "")
    rows = json.loads(stdout)
    reasons = [row.pop("reason") for row in rows]
    assert rows == [
        {"op": "index_fill", "stack": "vmap", "pattern": "others", "dtype": "float32", "native_status": "mismatch",
         "native_detail": "tensor-negdim: max abs error 3.52", "composite": "functional", "kind": "functional",
         "status": "ok"},
        {"op": "masked_fill", "stack": "vmap", "pattern": "all", "dtype": "float32", "native_status": "slow",
         "native_detail": "aten::masked_fill.Tensor has no batching rule", "composite": "functional",
         "kind": "functional", "status": "ok"},
        # nothing measured under vmap(grad): the shipped reference profiles rank the C++ op first there (the
        # primitive where it is not built)
        {"op": "masked_fill", "stack": "vmap(grad)", "pattern": "all", "dtype": "float32", "native_status": "slow",
         "native_detail": "aten::masked_fill.Tensor has no batching rule", "composite": FASTEST_FUSED,
         "kind": FASTEST_FUSED, "status": "not verified"},
    ]
    assert reasons == [_reason("index_fill", "vmap", ("index", "value")),
                       _reason("masked_fill", "vmap", ("self", "mask", "value")),
                       _reason("masked_fill", "vmap(grad)", ("self", "mask", "value"))]
    # The primitive is the fastest timing, but the matrix says it errs here: the reason names the functional one.
    assert reasons[1].startswith("functional is the fastest valid composite measured under vmap with self, mask, "
                                 "value batched (2.00x faster than native")
    assert reasons[0].startswith("native fails under vmap with index, value batched")

    code, stdout, _ = _run(["matrix", "--failing", "--op", "index_fill"], capsys)
    assert stdout.splitlines() == [
        "op          stack  pattern  dtype    native    choice      kind        status  reason",
        f"index_fill  vmap   others   float32  mismatch  functional  functional  ok      {reasons[0]}",
        "1 cells where native fails",
    ]


def test_native_failures_without_a_valid_composite_say_why() -> None:
    everything_fails = [_cell("masked_fill", name, ("vmap",), "all", "error", "x")
                        for name in ("native", "mutating", "functional", "primitive", "cpp_op")]
    rows = native_failures(everything_fails)
    assert [(r["composite"], r["kind"], r["status"]) for r in rows] == [(None, None, None)]
    assert rows[0]["reason"].startswith("select(masked_fill): no composite is valid under vmap with self, mask, "
                                        "value batched")


def test_profiles_and_report(seeded: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, stdout, _ = _run(["profiles", "--status", "invalid"], capsys)
    assert stdout.splitlines() == [
        "op           workload  dtype    batch  composite  median us  IQR us  vs native  detail",
        "masked_fill  vmap      float32  256    mutating   -          -       -          invalid: RuntimeError: vmap: "
        "inplace arithmetic",
        "1 profiles",
    ]
    png = tmp_path / "speedups.png"
    code, stdout, stderr = _run(["report", "--png", str(png)], capsys)
    assert (code, stderr) == (0, "")
    assert stdout.splitlines() == [
        "op           workload  dtype    batch  composite   speedup  low   high  note",
        "masked_fill  vmap      float32  256    functional  2.00x    1.81  2.21",
        "masked_fill  vmap      float32  256    mutating    -        -     -     invalid: profile invalid: "
        "RuntimeError: vmap: inplace arithmetic",
        "masked_fill  vmap      float32  256    primitive   -        -     -     invalid: error in the verified matrix "
        "under vmap, pattern all",
        f"wrote {png} (3 bars; error bars: each median +- IQR/2)",
        "re-measured (the first run was disturbed): none",
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, stdout, _ = _run(["report", "--json"], capsys)
    report = json.loads(stdout)
    assert report["png"] is None and report["remeasured"] == []
    assert [(b["composite"], b["speedup"], b["invalid"]) for b in report["bars"]] == [
        ("functional", 2.0, None), ("mutating", None, "profile invalid: RuntimeError: vmap: inplace arithmetic"),
        ("primitive", None, "error in the verified matrix under vmap, pattern all")]


def test_select_plain_and_json(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    reason = _reason("masked_fill", "vmap", ("self", "mask", "value"))
    code, stdout, _ = _run(["select", "masked_fill", "--stack", "vmap", "--batched", "self,mask,value",
                            "--dtype", "float32"], capsys)
    assert code == 0
    lines = stdout.splitlines()
    assert lines[:3] == ["masked_fill under vmap: functional (functional)", f"reason: {reason}",
                         "speedup over native: 2.00x"]
    assert lines[3] == "alternative  kind       verdict  why"
    assert lines[4].startswith("native       native     invalid  slow: ")
    code, stdout, _ = _run(["select", "masked_fill", "--stack", "vmap", "--batched", "self,mask,value",
                            "--dtype", "float32", "--json"], capsys)
    answer = json.loads(stdout)
    assert {k: answer[k] for k in ("op", "stack", "batched", "dtype", "device", "policy", "composite", "kind",
                                   "speedup")} == {
        "op": "masked_fill", "stack": "vmap", "batched": ["self", "mask", "value"], "dtype": "float32",
        "device": None, "policy": "auto", "composite": "functional", "kind": "functional",
        "speedup": pytest.approx(2.0)}
    assert [a["composite"] for a in answer["alternatives"]] == ["native", "mutating", "primitive", "cpp_op"]


def test_ops_jobs_and_survey_results(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = _run(["ops", "--op", "masked_fill"], capsys)
    composites = registry.composites("masked_fill")
    assert stdout.splitlines()[0].split() == ["op", "composite", "kind", "doc"]
    assert [line.split()[:3] for line in stdout.splitlines()[1:]] == [
        ["masked_fill", c.name, c.kind] for c in composites.values()]
    code, stdout, _ = _run(["ops", "--json"], capsys)
    assert [op["name"] for op in json.loads(stdout)] == list(registry.OPS)  # every op, whatever the lead adds

    code, stdout, _ = _run(["jobs"], capsys)
    assert stdout.splitlines() == [
        "id     kind    state  progress  created               finished              error",
        "job-1  verify  done   3/3       1970-01-01 00:00:00Z  1970-01-01 00:01:01Z  -",
    ]
    code, stdout, _ = _run(["jobs", "job-1", "--json"], capsys)
    assert json.loads(stdout) == {"id": "job-1", "kind": "verify", "params": {"ops": ["index_fill"]},
                                  "state": "done", "done": 3, "total": 3, "result": {"entries": 3}, "error": None,
                                  "owner": "host:1", "created_at": "1970-01-01T00:00:00.000Z",
                                  "started_at": "1970-01-01T00:00:01.000Z", "finished_at": "1970-01-01T00:01:01.000Z",
                                  "updated_at": "1970-01-01T00:01:01.000Z"}  # ISO 8601 with the zone (issue 20)
    code, stdout, _ = _run(["jobs", "--state", "running"], capsys)
    assert stdout.splitlines() == ["id  kind  state  progress  created  finished  error"]

    code, stdout, _ = _run(["survey-results", "--misbehaving"], capsys)
    assert stdout.splitlines() == [
        "op          stack  batching  dtype    native_status  use_status  max_abs_error  samples  detail",
        "index_fill  vmap   others    float32  mismatch       ok          2.5            2        max abs error 2.5",
        f"1 survey rows for torch {TORCH}",
    ]
    code, stdout, _ = _run(["survey-results", "--stack", "vmap,grad", "--json"], capsys)
    assert (code, json.loads(stdout)) == (0, [])


# --- bad input: one line on stderr, exit code 2 ----------------------------------------------------------------------


def _covered() -> str:
    return covered_ops()  # the registry's: the lead adds ops without editing this test


@pytest.mark.parametrize(("argv", "line"), [
    ("select nope", "multicomposite select: argument op: unknown op 'nope'. {ops} (see multicomposite select "
                    "--help)"),
    ("matrix --stack vmap(grad",
     "multicomposite matrix: argument --stack: unbalanced or mixed stack 'vmap(grad': write it nested, vmap(grad), "
     "or as a list, vmap,grad (see multicomposite matrix --help)"),
    ("matrix --stack vmap(wat)",
     "multicomposite matrix: argument --stack: unknown transform 'wat' in stack 'vmap(wat)'; valid: vmap, grad, jvp, "
     "functionalize, autograd, compile, jacrev, jacfwd, hessian (see multicomposite matrix --help)"),
    ("profiles --dtype float33",
     "multicomposite profiles: argument --dtype: unknown dtype 'float33'; use a torch dtype name such as float32, "
     "float64, float16, bfloat16, int64, int32, bool, complex64 (see multicomposite profiles --help)"),
    ("report --png /nonexistent/dir/r.png",
     "multicomposite report: argument --png: the folder /nonexistent/dir does not exist; create it, or write the PNG "
     "elsewhere (see multicomposite report --help)"),
    ("report --png report.txt",
     "multicomposite report: argument --png: 'report.txt' does not end in .png (see multicomposite report --help)"),
    ("matrix --status great",
     "multicomposite matrix: argument --status: invalid choice: 'great' (choose from 'ok', 'slow', 'error', "
     "'mismatch', 'unsupported') (see multicomposite matrix --help)"),
    ("select index_fill --batched index --stack grad",
     "multicomposite select: select(index_fill): batched=index needs vmap in the stack"),
    ("select index_fill --batched wat --stack vmap",
     "multicomposite select: select(index_fill): batched names wat are not tensor arguments of index_fill; its "
     "tensor arguments are self, index, value"),
    ("select index_fill --dtype int64 --stack grad",
     "multicomposite select: dtype int64 has no derivative under grad: grad needs a floating point or complex dtype"),
    ("select index_fill --pin nope",
     "multicomposite select: pins['index_fill'] = 'nope' names no composite or kind of index_fill; registered: "
     "native, mutating, functional, primitive, cpp_op; kinds: native, mutating, functional, primitive, custom_op, "
     "cpp_op"),
    ("jobs nope", "multicomposite jobs: no job 'nope' in the store at {url}; `multicomposite jobs` lists them"),
    ("matrix --failing --png {tmp}/m.png",
     "multicomposite matrix: --failing lists cells; it has no PNG: drop --png, or --failing to render the matrix"),
    ("profile --min-run-time -1",
     "multicomposite profile: argument --min-run-time: '-1' is not a positive number of seconds (see multicomposite "
     "profile --help)"),
])
def test_bad_input_is_one_line_and_exit_2(argv: str, line: str, seeded: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv_list = argv.format(tmp=tmp_path).split()
    code, stdout, stderr = _run(argv_list, capsys)
    assert (code, stdout, stderr) == (2, "", line.format(ops=_covered(), url=seeded) + "\n")


def test_png_into_a_folder_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # A short path: the message shortens a long one (pytest-xdist's tmp_path is longer than 100 characters).
    folder = Path(tempfile.mkdtemp(prefix="mc-")) / "plots.png"
    folder.mkdir()
    code, _, stderr = _run(["report", "--png", str(folder)], capsys)
    assert (code, stderr) == (2, f"multicomposite report: argument --png: {folder} is a folder; name a PNG file "
                                 "inside it (see multicomposite report --help)\n")


def test_an_empty_store_says_what_to_run(empty_store: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["matrix"], capsys)[::2] == (
        2, "multicomposite matrix: the store has no fresh entries; run `multicomposite verify` first\n")
    assert _run(["report"], capsys)[::2] == (
        2, "multicomposite report: the store has no fresh profiles; run `multicomposite profile` first\n")


def test_unknown_command_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = _run(["nope"], capsys)
    assert code == 2
    assert stderr.startswith("multicomposite: argument COMMAND: invalid choice: 'nope' (choose from ")
    assert stderr.endswith(" (see multicomposite --help)\n") and stderr.count("\n") == 1
    code, stdout, _ = _run(["matrix", "--help"], capsys)
    assert code == 0 and "--failing" in stdout


# --- output: plain off a terminal, rich on one ------------------------------------------------------------------------


def test_plain_progress_is_a_line_per_tenth_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with cli_output.progress("verify", "entries") as progress:
        for done in range(1, 21):
            progress(done, 20, f"case {done}")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "multicomposite verify: entries 1/20 (5%) case 1",
        "multicomposite verify: entries 2/20 (10%) case 2",
        "multicomposite verify: entries 4/20 (20%) case 4",
        "multicomposite verify: entries 6/20 (30%) case 6",
        "multicomposite verify: entries 8/20 (40%) case 8",
        "multicomposite verify: entries 10/20 (50%) case 10",
        "multicomposite verify: entries 12/20 (60%) case 12",
        "multicomposite verify: entries 14/20 (70%) case 14",
        "multicomposite verify: entries 16/20 (80%) case 16",
        "multicomposite verify: entries 18/20 (90%) case 18",
        "multicomposite verify: entries 20/20 (100%) case 20",
    ]


def test_on_a_terminal_rich_draws_tables_and_bars(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli_output, "is_terminal", lambda stream: True)
    cli_output.print_table(("op", "status"), [("index_fill", "ok")])
    with cli_output.progress("verify", "entries") as progress:
        progress(1, 2, "first")
        progress(2, 2, "second")
    captured = capsys.readouterr()
    # The last column holds free text: at least 20 wide, so that it wraps in words, not letters.
    assert "┃ op         ┃ status               ┃" in captured.out
    assert "│ index_fill │ ok                   │" in captured.out
    assert "entries" in captured.err and "2/2" in captured.err  # the bar, on stderr
    assert "entries" not in captured.out


def test_json_has_no_nan(capsys: pytest.CaptureFixture[str]) -> None:
    cli_output.print_json({"error": float("nan"), "values": [1.5, float("inf")]})
    assert json.loads(capsys.readouterr().out) == {"error": None, "values": [1.5, None]}


def test_plain_table_pads_all_but_the_last_column() -> None:
    assert cli_output.plain_table(("a", "bb", "c"), [("xxx", None, "free text"), ("y", 0.123456, "")]) == [
        "a    bb     c", "xxx  -      free text", "y    0.123"]


# --- the commands that run: verify and profile -----------------------------------------------------------------------


def test_verify_prints_choices_and_progress_goes_to_stderr(empty_store: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _run(["verify", "--op", "masked_fill", "--stack", "vmap", "--dtype", "float32"], capsys)
    assert code == 0
    lines = stdout.splitlines()
    assert lines[:3] == ["entries by status; under each stack, the composite auto chooses with self batched [its "
                         "worst status there]",
                         "op           entries  ok  slow  mismatch  error  unsupported  vmap",
                         # both ok; the shipped reference profiles rank the C++ op (else the primitive) first
                         f"masked_fill  20       12  7     0         1      0            {FASTEST_FUSED} [ok]"]
    assert lines[3].startswith("20 entries in ") and lines[3].endswith(f" s, written to {empty_store}")
    progress = stderr.splitlines()
    # Entries finish in worker processes, in no fixed order: the counts are exact, the labels any entry's.
    assert progress[0].startswith("multicomposite verify: entries 1/20 (5%) masked_fill/")
    assert progress[-1].startswith("multicomposite verify: entries 20/20 (100%) masked_fill/")
    assert all(line.startswith("multicomposite verify: entries ") for line in progress)

    code, stdout, stderr = _run(["verify", "--op", "masked_fill", "--stack", "vmap", "--dtype", "float32", "--json"],
                                capsys)
    entries = json.loads(stdout)
    assert code == 0 and len(entries) == 20  # 5 composites x 4 batching patterns
    assert {(e["composite"], e["pattern"], e["status"]) for e in entries if e["composite"] == "functional"} == {
        ("functional", pattern, "ok") for pattern in ("all", "self", "others", "in_dims1")}
    assert stderr.splitlines()[-1].startswith("multicomposite verify: entries 20/20 (100%) masked_fill/")


def test_profile_json_holds_the_profiles_and_the_refused(empty_store: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _run(["profile", "--op", "index_fill", "--stack", "vmap", "--batch", "4",
                                 "--min-run-time", "0.02", "--json"], capsys)
    assert code == 0
    answer = json.loads(stdout)
    assert sorted(answer) == ["profiles", "refused", "seconds"]
    timed = {p["composite"] for p in answer["profiles"]}
    # Either every composite of the context was stored, or the context was refused as too noisy (and said why).
    assert timed == set(registry.composites("index_fill")) or (
        len(answer["refused"]) == 1 and answer["refused"][0].startswith("index_fill vmap n=1024 b=4 float32: not "
                                                                        "stored"))
    assert stderr.splitlines()[-1] == "multicomposite profile: timings 5/5 (100%) index_fill/cpp_op vmap n=1024 b=4"


def test_a_subcommand_plugs_in_as_one_row(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """How `db upgrade` or `worker` join: a row in SUBCOMMANDS and a configure() in their own module."""
    from service import cli
    from service.cli_output import UsageError

    def upgrade(args: argparse.Namespace) -> int:
        if args.to == "bad":
            raise UsageError("no revision 'bad'; revisions: head")
        print(f"upgraded to {args.to}")
        return 0

    def configure(parser: argparse.ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="db_command", required=True, parser_class=type(parser),
                                        metavar="ACTION", help="what to do with the store")
        step = actions.add_parser("upgrade", help="bring the schema up to date")
        step.add_argument("--to", default="head", help="the revision (default: head)")
        step.set_defaults(run=upgrade)

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, cli.Subcommand("plug", "manage the store", configure)])
    assert _run(["plug", "upgrade"], capsys)[:2] == (0, "upgraded to head\n")
    assert _run(["plug", "upgrade", "--to", "bad"], capsys)[::2] == (
        2, "multicomposite plug: no revision 'bad'; revisions: head\n")
    assert _run(["plug", "downgrade"], capsys)[0] == 2
    assert [f"{w} {a.dest}" for w, a in _actions(cli.build_parser()) if not a.help] == []


# --- issue 20, part 5: the bar, wide tables, repeated notes ----------------------------------------------------------


def test_the_bar_shows_at_once_with_an_estimate(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing showed for the first ~10 s of verify (the bar waited for the first entry), and it had no ETA.
    monkeypatch.setattr(cli_output, "is_terminal", lambda stream: True)
    with cli_output.progress("verify", "entries") as progress:
        before = capsys.readouterr().err  # drawn when the block starts, before any report
        progress(1, 4, "first")
    after = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().err)
    assert "entries" in before and "starting" in before
    assert re.search(r"1/4 \d:\d\d:\d\d elapsed, (-:--:--|\d:\d\d:\d\d) left first", after), after  # then the ETA


def test_the_bars_counts_and_times_keep_their_width_on_80_columns(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # On an 80-column terminal a long label squeezed the counts and times to "1…" and "0:…".
    monkeypatch.setattr(cli_output, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "80")
    with cli_output.progress("verify", "entries") as progress:
        progress(144, 1200, "index_fill/native functionalize(jvp(jvp)) self,value float32 " + "x" * 40)
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().err).replace("\r", "\n").splitlines()
    last = [line for line in drawn if "144/1200" in line][-1]
    assert re.search(r" 144/1200 \d:\d\d:\d\d elapsed, (-:--:--|\d:\d\d:\d\d) left index_fill", last), last
    assert last.rstrip().endswith("…") and len(last.rstrip()) <= 80


def test_a_terminal_table_folds_wide_cells_instead_of_cutting_them(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli_output, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "120")
    cells = [f"cell{i}-" + "x" * 20 for i in range(8)]
    cli_output.print_table([f"column{i}" for i in range(8)], [cells])
    printed = capsys.readouterr().out
    assert "…" not in printed  # was: every column but the last cut with an ellipsis
    assert printed.count("x") == 8 * 20  # every character of every cell, folded onto more lines where needed
    assert max(len(line) for line in printed.splitlines()) <= 120  # within the terminal's width


def test_a_note_shared_by_rows_is_printed_once(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # `profiles` repeated a run's note (a re-measurement, say) on every row of that run.
    note = "re-measured 1x: spread 0.31 over 0.25"
    timings = [_timing("masked_fill", name, median, 1.0, detail=f"{note}; first call {first} ms")
               for name, median, first in (("native", 40.0, 1.5), ("functional", 20.0, 0.9))]
    url = f"sqlite:///{tmp_path / 'notes.db'}"
    monkeypatch.setenv("MULTICOMPOSITE_DB", url)
    with Store(url) as store:
        store.write_profiles(timings)
    code, stdout, _ = _run(["profiles"], capsys)
    assert (code, stdout.splitlines()) == (0, [
        "op           workload  dtype    batch  composite   median us  IQR us  vs native  detail",
        "masked_fill  vmap      float32  256    functional  20.0       1.0     2.00x      [1]; first call 0.9 ms",
        "masked_fill  vmap      float32  256    native      40.0       1.0     1.00x      [1]; first call 1.5 ms",
        f"[1] {note}",
        "2 profiles",
    ])


def test_footnotes_leave_unique_notes_alone() -> None:
    assert cli_output.footnote_repeats([("a", "x; y"), ("b", "x"), ("c", None), ("d", "z")]) == (
        [("a", "[1]; y"), ("b", "[1]"), ("c", None), ("d", "z")], ["[1] x"])
