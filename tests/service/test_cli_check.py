"""``multicomposite check FILE.py:FUNCTION --example FILE.py:MAKE_ARGS``: the report as a table or JSON, exit 0 when
use() is ok, 1 when not, 2 with one line per usage problem."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from service.cli import main

MODEL = textwrap.dedent('''
    import torch

    base, index = torch.zeros(5, 4), torch.tensor([0, 2])


    def per_sample(x):  # the README's example: wrong natively under vmap(grad)
        return (base.index_fill(0, index, x.sum()) * x).pow(2).sum()


    def two_arguments(x, y):
        return (x * y).sum()


    def broken(x):
        return x.sum() / undefined_name


    def make_args():
        return (torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(0)),)
''')


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err, "escape codes off a terminal"
    return code, captured.out, captured.err


def test_the_table_says_native_is_wrong_and_use_is_right(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["check", f"{model}:per_sample", "--example", f"{model}:make_args", "--rounds", "1"],
                          capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "native is silently wrong" in lines[0]
    assert lines[1].split()[:3] == ["run", "verdict", "time"]
    assert lines[2].split()[:2] == ["native", "mismatch"] and lines[3].split()[:2] == ["use()", "ok"]
    assert any(line.startswith("index_fill  vmap(grad)  value") for line in lines)


def test_json_is_the_whole_report(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["check", f"{model}:per_sample", "--example", f"{model}:make_args", "--rounds", "1",
                         "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert (report["native"]["verdict"], report["use"]["verdict"]) == ("mismatch", "ok")
    assert report["decisions"][0]["op"] == "index_fill"
    assert report["use"]["time_s"] > 0 and report["reference"]["time_s"] > 0


def test_exit_1_when_use_is_not_ok(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["check", f"{model}:broken", "--example", f"{model}:make_args", "--rounds", "1"], capsys)
    assert code == 1
    assert "NameError: name 'undefined_name' is not defined at " in out
    assert "model.py:" in out and "return x.sum() / undefined_name" in out


@pytest.mark.parametrize(("argv", "lines"), [
    (["missing.py:per_sample", "--example", "{model}:make_args"],
     ["the function's file missing.py does not exist; give the path of a Python file (FILE.py:FUNCTION)"]),
    (["{model}:nothing", "--example", "{model}:make_nothing"],
     ["{model} has no function 'nothing'; its functions: broken, make_args, per_sample, two_arguments",
      "{model} has no function 'make_nothing'; its functions: broken, make_args, per_sample, two_arguments"]),
    (["{model}:two_arguments", "--example", "{model}:make_args"],
     ["two_arguments ({model}:11) does not take the 1 example arguments: missing a required argument: 'y'"]),
    (["{model}:per_sample", "--example", "{model}:make_args", "--in-dims", "0,None"],
     ["in_dims (0, None) has 2 entries for 1 arguments; give one per argument (None: not batched)"]),
    (["{model}:per_sample", "--example", "{model}:make_args", "--in-dims", "3"],
     ["in_dims[0] = 3 is out of range for argument 0's tensor of shape (6, 5, 4); give a dim in 0..2, or None for "
      "an argument that is not batched"]),
    (["{model}:per_sample", "--example", "{model}:make_args", "--transform", "vmap(grd)"],
     ["unknown layer 'grd' in stack 'vmap(grd)'; layers are vmap, grad, jvp, jacrev, jacfwd, hessian, functionalize, "
      "compile"]),
])
def test_usage_problems_one_line_each_exit_2(model: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                             lines: list[str]) -> None:
    code, out, err = _run(["check", *(a.format(model=model) for a in argv)], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"multicomposite check: {line.format(model=model)}" for line in lines]


def test_a_bad_in_dims_spelling_is_argparse_s_line(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["check", f"{model}:per_sample", "--example", f"{model}:make_args", "--in-dims", "rows"],
                        capsys)
    assert code == 2
    assert err == ("multicomposite check: argument --in-dims: 'rows' is not in_dims: give a dim (0), None, or one per "
                   "argument separated by commas (None,0,0) (see multicomposite check --help)\n")


def test_a_file_that_fails_to_import_is_one_line(tmp_path: Path, model: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\nscale = 1 / 0\n")
    code, out, err = _run(["check", f"{broken}:f", "--example", f"{model}:make_args"], capsys)
    assert (code, out) == (2, "")
    assert err == (f"multicomposite check: importing {broken} failed at {broken}:3: ZeroDivisionError: division by "
                   "zero; fix the file, then run the check again\n")
