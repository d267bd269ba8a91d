"""``python -m bench.routing_instructions [--tree PATH ...] [--calls 200]``: what routing costs, in instructions a
call (valgrind's callgrind), for source trees side by side.

``bench.routing`` times the same cases; a difference of a few percent between two trees is below its run-to-run
spread on a small shared machine, and the count of instructions is not. Each tree (``--tree``, a checkout of this
project; default: this one) runs in its own process under ``valgrind --tool=callgrind --collect-atstart=no`` with
``PYTHONPATH`` pointing at it and ``MULTICOMPOSITE_ROUTING=cpp`` (its own C++ kernels; build them first with
``multicomposite build-kernels`` run from that tree). The cases, on ``masked_fill`` of 64 x 32 float32 with a boolean
mask, one intra-op thread, each ``--calls`` calls counted after 20 uncounted ones, with the garbage collector off
(as ``timeit`` runs):

- vmap(grad) outside ``use()``, once the kernels are registered (bench.routing's r0);
- vmap(grad) inside ``use()`` (r2's shape: a whole call whose covered op is routed);
- the eager covered op inside ``use()``, with its ``with`` (r4), and ``with use(): pass`` alone (r1);
- the eager covered op outside ``use()``.

This file's ``child`` runs inside the measured tree and imports nothing of this package but ``registry``, so it also
runs against trees that predate it. Needs valgrind (Debian: ``apt-get install valgrind``); about three minutes a tree,
most of it importing PyTorch under valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = "callgrind.out"
LABELS = "labels.json"


def child(labels_path: Path, calls: int) -> None:
    """The cases, each counted section dumped on its own (runs under valgrind, in the measured tree)."""
    import gc
    import warnings

    import torch
    from torch import func

    torch.set_num_threads(1)
    os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{labels_path.parent}/empty.db"  # an empty store: no local profiles
    import registry
    from registry.core import routing

    warnings.simplefilter("ignore")
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    mask = torch.rand(64, 32, generator=torch.Generator().manual_seed(1)) > 0.5
    per_sample = func.vmap(func.grad(lambda x, mask: x.masked_fill(mask, 0.0).sin().sum()))

    def inside() -> object:
        with registry.use():
            return per_sample(x, mask)

    def eager_inside() -> object:
        with registry.use():
            return x.masked_fill(mask, 0.0)

    def enter_only() -> None:
        with registry.use():
            pass

    inside()  # registers the kernels before the first case
    cases = {"vmap(grad) outside use()": lambda: per_sample(x, mask), "vmap(grad) inside use()": inside,
             "eager covered op inside use()": eager_inside, "with use(): pass": enter_only,
             "eager covered op outside use()": lambda: x.masked_fill(mask, 0.0)}
    for case in cases.values():
        for _ in range(20):
            case()
        # As timeit (and so bench.routing) does: the garbage collector off while counting. Where its passes land in
        # a window of 200 calls moves a count by a percent or two between processes.
        gc.collect()
        gc.disable()
        torch._C._valgrind_toggle()  # collection on
        for _ in range(calls):
            case()
        torch._C._valgrind_toggle_and_dump_stats()  # collection off; this case's counts to a file
        gc.enable()
    labels_path.write_text(json.dumps({"cases": list(cases), "calls": calls, "backend": routing.routing_backend(),
                                       "registry": registry.__file__}))


def measure(valgrind: str, tree: Path, calls: int) -> dict[str, float]:
    """Instructions a call of every case, in ``tree``."""
    from bench.instructions import instructions_in  # here, not at the top: the child runs in trees without it

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        # -P: the script's own folder (bench/) is not put first on sys.path, so ``registry`` is the tree's.
        env = dict(os.environ, PYTHONPATH=str(tree), MULTICOMPOSITE_ROUTING="cpp")
        command = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={folder / OUT}",
                   f"--log-file={folder / 'valgrind.log'}", sys.executable, "-P", str(Path(__file__).resolve()),
                   "--child", str(folder / LABELS), "--calls", str(calls)]
        completed = subprocess.run(command, env=env, check=False, cwd=folder)
        if completed.returncode != 0 or not (folder / LABELS).exists():
            log = (folder / "valgrind.log").read_text()[-2000:] if (folder / "valgrind.log").exists() else ""
            raise RuntimeError(f"{tree}: the run under valgrind exited {completed.returncode}\n{log}")
        labels = json.loads((folder / LABELS).read_text())
        if labels["backend"] != "cpp" or not labels["registry"].startswith(str(tree.resolve())):
            raise RuntimeError(f"{tree}: measured {labels['registry']} on the {labels['backend']} backend; build "
                               "that tree's kernels (multicomposite build-kernels, run from it)")
        return {case: instructions_in(folder / f"{OUT}.{index}") / calls
                for index, case in enumerate(labels["cases"], start=1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_instructions",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, default=None,
                        help="a checkout of this project to measure (repeatable; default: this one)")
    parser.add_argument("--calls", type=int, default=200, help="counted calls a case (default 200)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # where to write the labels
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.calls)
        return 0
    from bench.instructions import find_valgrind

    valgrind = find_valgrind("python -m bench.routing_instructions")
    if valgrind is None:
        return 2
    trees = args.tree or [Path(__file__).resolve().parent.parent]
    results = {tree: measure(valgrind, tree, args.calls) for tree in trees}
    cases = list(next(iter(results.values())))
    print(f"instructions a call under callgrind, {args.calls} calls a case; trees: "
          + ", ".join(f"[{i}] {tree}" for i, tree in enumerate(trees)))
    header = "".join(f"{f'[{i}]':>12}" for i in range(len(trees)))
    ratios = "".join(f"{f'[{i}]/[0]':>10}" for i in range(1, len(trees)))
    print(f"{'case':34}{header}{ratios}")
    for case in cases:
        counts = [results[tree][case] for tree in trees]
        print(f"{case:34}" + "".join(f"{count:>12,.0f}" for count in counts)
              + "".join(f"{count / counts[0]:>10.3f}" for count in counts[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
