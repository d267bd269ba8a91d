"""``python -m bench.instructions [--batches 4,16,64] [--only NAME ...] [--steps 3]``: use() against native, in
instructions executed (valgrind's callgrind).

``bench.small_batches`` times use() against native in thread CPU time; on a small shared machine its readings of one
workload move by 2-5 % between runs, which is the size of the difference it is asked to show (use() at least 0.97x
native). The number of instructions a step executes does not move that way: it is what use() adds to a step, counted
(the Python frames of ``use()``, the routing kernels' lookups, the composites chosen, the garbage collector's extra
passes). It does not see what the instructions cost (cache misses, page faults, vector width), so it complements the
timing and does not replace it; PyTorch measures its own overheads the same way
(``torch.utils.benchmark.Timer.collect_callgrind``).

The command runs itself again under ``valgrind --tool=callgrind --collect-atstart=no`` (one process: PyTorch is
imported once, which takes minutes under valgrind). For each workload of ``bench.small_batches`` and batch size: the
workload is built, use()'s result is checked against native's, each way runs two uncounted steps, then ``--steps``
counted steps natively and ``--steps`` inside ``registry.use()`` (an empty store, policy auto, one intra-op thread),
each counted section dumped on its own. A row reports the instructions per step both ways and native / use() (above
1: use() executes fewer). Needs valgrind (Debian: ``apt-get install valgrind``); about a minute per row after the
import.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

TARGET = 0.97
LABELS = "labels.json"
OUT = "callgrind.out"
_TOTAL = re.compile(r"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def instructions_in(dump: Path) -> int:
    """The instructions a callgrind dump counted."""
    match = _TOTAL.search(dump.read_text())
    if match is None:
        raise ValueError(f"{dump}: no 'summary:' or 'totals:' line; is it a callgrind output file?")
    return int(match.group(1))


def find_valgrind(command: str) -> str | None:
    """valgrind's path, or None after one line on stderr saying how to install it (``command`` names the caller)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print(f"{command}: valgrind not found; install it (Debian: apt-get install valgrind)", file=sys.stderr)
    return valgrind


def child(folder: Path, batches: list[int], only: list[str] | None, steps: int) -> None:
    """Runs under valgrind: every counted section is dumped on its own, its label appended to ``labels.json``."""
    import torch

    import registry
    from bench.small_batches import equal_results, workloads

    torch.set_num_threads(1)
    os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{folder}/empty.db"  # a new user's empty store
    labels: list[dict[str, object]] = []
    for workload in workloads():
        if only is not None and workload.name not in only:
            continue
        for batch in batches:
            setup = workload.build(batch)

            def inside(step: Callable[[], object] = setup.step) -> object:  # this row's step, bound now
                with registry.use():
                    return step()

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    native = setup.step()
                except Exception as error:  # a workload that fails natively is reported, not counted
                    labels.append({"workload": workload.name, "batch": batch,
                                   "status": f"native fails: {type(error).__name__}"})
                    continue
                if not equal_results(inside(), native, setup):
                    labels.append({"workload": workload.name, "batch": batch, "status": "use() differs from native"})
                    continue
                for way, stmt in (("native", setup.step), ("use", inside)):
                    for _ in range(2):
                        stmt()
                    torch._C._valgrind_toggle()  # collection on
                    for _ in range(steps):
                        stmt()
                    torch._C._valgrind_toggle_and_dump_stats()  # collection off; this section's counts to a file
                    labels.append({"workload": workload.name, "batch": batch, "way": way, "steps": steps})
            (folder / LABELS).write_text(json.dumps(labels))


def report(folder: Path) -> float:
    """Print one row per workload and batch from the dumps in ``folder``; returns the worst native / use()."""
    labels = json.loads((folder / LABELS).read_text())
    dumps = sorted(folder.glob(f"{OUT}.*"), key=lambda path: int(path.suffix.lstrip(".") or 0))
    counted = [label for label in labels if "way" in label]
    if len(dumps) < len(counted):
        raise RuntimeError(f"{len(counted)} counted sections but {len(dumps)} callgrind dumps in {folder}")
    per_step: dict[tuple[str, int], dict[str, float]] = {}
    dump_of = iter(dumps)
    print(f"{'workload':34} {'batch':>5} {'native Minstr':>14} {'use Minstr':>11} {'native/use':>10}")
    worst = float("inf")
    for label in labels:
        key = (label["workload"], label["batch"])
        if "way" not in label:
            print(f"{key[0]:34} {key[1]:>5} {label['status']}")
            continue
        per_step.setdefault(key, {})[label["way"]] = instructions_in(next(dump_of)) / label["steps"]
        ways = per_step[key]
        if len(ways) == 2:
            ratio = ways["native"] / ways["use"]
            worst = min(worst, ratio)
            print(f"{key[0]:34} {key[1]:>5} {ways['native'] / 1e6:>14.2f} {ways['use'] / 1e6:>11.2f} {ratio:>9.3f}x")
    print(f"worst native/use {worst:.3f}x in instructions (target >= {TARGET:.2f}x in time)")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="4,16,64", help="comma-separated batch sizes (default 4,16,64)")
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all)")
    parser.add_argument("--steps", type=int, default=3, help="counted steps each way (default 3)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the folder, when running under valgrind
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.child is not None:
        child(Path(args.child), batches, args.only, args.steps)
        return 0
    valgrind = find_valgrind("python -m bench.instructions")
    if valgrind is None:
        return 2
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        command = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={folder / OUT}",
                   "--log-file=" + str(folder / "valgrind.log"), sys.executable, "-m", "bench.instructions",
                   "--child", str(folder), "--batches", args.batches, "--steps", str(args.steps)]
        if args.only is not None:
            command += ["--only", *args.only]
        import torch

        print(f"torch {torch.__version__}, 1 thread, instructions per step under callgrind, {args.steps} steps each "
              "way", flush=True)
        completed = subprocess.run(command, check=False)
        if completed.returncode != 0 or not (folder / LABELS).exists():
            log = (folder / "valgrind.log").read_text()[-2000:] if (folder / "valgrind.log").exists() else ""
            print(f"python -m bench.instructions: the run under valgrind exited {completed.returncode}\n{log}",
                  file=sys.stderr)
            return 1
        report(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
