"""``multicomposite check file.py:function --example file.py:make_args``: is the user's transformed function right
natively and inside ``use()``, what did ``use()`` choose and why, and what do native, use() and the per-sample
reference cost (``registry.check``).

The function and the function that builds its example arguments are imported from the user's own files, by path
(the file's folder first on ``sys.path`` while it imports, as when running it as a script). Exit 0 when use()'s
verdict is ok, 1 when it is not, 2 for a usage problem: each problem one line on stderr, saying what to do.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from registry.core.policies import POLICIES
from service import cli_output as out
from service.cli import arguments


class _Problems(Exception):  # noqa: N818 -- the usage problems found, one line each
    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def _shorten(text: str) -> str:
    from registry.core.stacks import shorten  # only for an error line: it imports the registry (torch)

    return shorten(text, 80)


def target(text: str) -> tuple[Path, str]:
    """``path/to/file.py:name`` as (path, name); the file is looked for when the command runs."""
    path, colon, name = text.rpartition(":")
    if not colon or not path or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{_shorten(text)!r} is not FILE.py:FUNCTION (for example "
                                         "model.py:per_sample_loss)")
    return Path(path), name


def in_dims(text: str) -> int | tuple[int | None, ...] | None:
    """``0`` (every argument batched at dim 0), ``None``, or one per argument: ``None,0,0``."""
    parts = [part.strip() for part in text.split(",")]
    dims: list[int | None] = []
    for part in parts:
        if part in ("None", "none", "-"):
            dims.append(None)
            continue
        try:
            dims.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{_shorten(text)!r} is not in_dims: give a dim (0), None, or one per argument "
                "separated by commas (None,0,0)") from None
    return dims[0] if len(dims) == 1 and "," not in text else tuple(dims)


def argnums(text: str) -> int | tuple[int, ...]:
    """``0``, or several positions separated by commas: ``0,1``."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{_shorten(text)!r} is not argnums: give an argument's "
                                         "position (0) or several separated by commas (0,1)")
    return values[0] if len(values) == 1 and "," not in text else values


def _module(path: Path, problems: list[str], what: str) -> Any:
    """The user's file imported by path, or None with the problem added."""
    if not path.is_file():
        where = "is a folder" if path.is_dir() else "does not exist"
        problems.append(f"{what} file {path} {where}; give the path of a Python file (FILE.py:FUNCTION)")
        return None
    from registry.core.messages import described

    resolved = path.resolve()
    name = f"multicomposite_check_{abs(hash(str(resolved)))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        problems.append(f"{what} file {path} cannot be imported as Python; give a .py file")
        return None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(resolved.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: whatever it raises is theirs to fix
        del sys.modules[name]
        from registry.core.frames import raising_user_frame

        frame = raising_user_frame(error.__traceback__)
        at = f" at {frame.where}" if frame is not None else ""
        problems.append(f"importing {path} failed{at}: {described(error)}; fix the file, then run the check again")
        return None
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def _function(path: Path, name: str, problems: list[str], what: str) -> Any:
    module = _module(path, problems, what)
    if module is None:
        return None
    found = getattr(module, name, None)
    if found is None or not callable(found):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        listed = f"; its functions: {', '.join(defined[:8])}" if defined else ""
        problems.append(f"{path} has no function {name!r}{listed}")
        return None
    return found


def _example_args(build: Any, path: Path, name: str) -> tuple[Any, ...]:
    from registry.core.messages import described

    try:
        made = build()
    except Exception as error:  # the user's function
        raise _Problems([f"{path}:{name}() raised {described(error)}; it must return the example arguments (a "
                         "tuple)"]) from None
    return tuple(made) if isinstance(made, (tuple, list)) else (made,)


def _rows(report: Any) -> list[tuple[object, ...]]:
    rows = []
    for run in (report.native, report.use):
        worst = run.worst
        if run.error:
            detail = f"{run.error} at {run.where}" if run.where else run.error
        elif run.fallbacks:
            detail = f"vmap looped over the batch for {', '.join(run.fallbacks)}"
        else:
            detail = worst.detail if worst is not None and worst.detail else ""
        rows.append((run.name, run.verdict, _ms(run.time_s), worst.name if worst else None,
                     worst.max_abs if worst else None, worst.max_rel if worst else None, detail))
    reference = report.reference
    rows.append(("reference", "error" if reference.error else "", _ms(reference.time_s), None, None, None,
                 (f"{reference.error} at {reference.where}" if reference.where else reference.error) or
                 "per-sample loop outside any transform"))
    return rows


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1e3:.3g} ms"


def run(args: argparse.Namespace) -> int:
    problems: list[str] = []
    (fn_path, fn_name), (example_path, example_name) = args.function, args.example
    fn = _function(fn_path, fn_name, problems, "the function's")
    build = _function(example_path, example_name, problems, "the example's")
    if problems:
        raise _Problems(problems)
    example = _example_args(build, example_path, example_name)

    import registry
    from registry.harness.check import CheckError

    dims = 0 if args.in_dims is None else args.in_dims
    try:
        report = registry.check(fn, *example, transform=args.transform, in_dims=dims, argnums=args.argnums,
                                policy=args.policy, rounds=args.rounds)
    except CheckError as error:
        raise _Problems([str(error)]) from None
    if args.json:
        out.print_json(report.to_json())
        return 0 if report.ok else 1
    print(f"{report.function} under {report.transform} (policy {report.policy}): {report.summary()}")
    out.print_table(("run", "verdict", "time", "worst output", "max abs", "max rel", "detail"), _rows(report))
    if report.decisions:
        out.print_table(("op", "stack", "batched", "composite", "kind", "calls", "reason"),
                        [(d.op, d.stack, ", ".join(d.batched) or None, d.composite, d.kind, d.calls, d.reason)
                         for d in report.decisions], title="decisions inside use()")
    else:
        print("decisions inside use(): none (no covered op was called under the transform)")
    for name in report.functionalized:
        print(f"functionalized automatically inside use(): {name}")
    for split in report.splits:
        print(f"batch split inside use(): {split}")
    bounds = ", ".join(f"{dtype} rtol {rtol:g} atol {atol:g}" for dtype, (rtol, atol) in report.bounds.items())
    print(f"compared at the {report.tolerance!r} tolerance ({bounds or 'nothing compared'}); {report.timing}")
    for note in report.notes:
        print(note)
    return 0 if report.ok else 1


def main_run(args: argparse.Namespace) -> int:
    """``run``, each usage problem one line on stderr (exit 2)."""
    try:
        return run(args)
    except _Problems as found:
        for line in found.lines:
            print(f"multicomposite check: {line}", file=sys.stderr)
        return 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("function", type=target, help="the per-sample function to check: FILE.py:FUNCTION (your "
                        "file, imported by path)")
    parser.add_argument("--example", type=target, required=True, help="FILE.py:FUNCTION that takes no arguments "
                        "and returns the batched example arguments (a tuple)")
    parser.add_argument("--transform", default="vmap(grad)", help="the transforms, outermost first: vmap(grad), "
                        "vmap, vmap(jacrev), vmap(hessian), ... (default: vmap(grad))")
    parser.add_argument("--in-dims", type=in_dims, default=None, help="each argument's batch dim: 0 for all "
                        "(default), or one per argument, None for an unbatched one (None,0,0)")
    parser.add_argument("--argnums", type=argnums, default=0, help="the arguments grad and the Jacobians "
                        "differentiate: 0 (default) or 0,1")
    parser.add_argument("--policy", default="auto", choices=POLICIES,
                        help=f"use()'s policy: {', '.join(POLICIES)} (default: auto)")
    parser.add_argument("--rounds", type=arguments.positive_int, default=5, help="interleaved timing rounds "
                        "(default: 5; the median is shown)")
    arguments.add_json(parser, "the whole report")
    parser.set_defaults(run=main_run)
