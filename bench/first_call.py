"""What the first routed call costs in a fresh process (``python -m bench.first_call``).

Each round starts two fresh interpreters, alternately: one makes a call (``vmap`` of ``index_fill`` over a batch of 4)
outside ``use()``, the other makes the same call as the first inside ``use()`` (entering it included). Both import
torch and registry first, untimed; the times are of the call alone, and of ``import registry`` (after torch). The
median over rounds is reported, wall clock and CPU time, and the difference of the two calls is what routing adds to
a first call (target: at most 50 ms). ``--store`` gives both a fresh store, so the routed call also reads its
evidence.

Right after ``import torch`` and ``import registry`` the cyclic garbage collector owes a full collection of the heap
(tens of milliseconds): the next few hundred allocations pay it, wherever they are. The small call outside ``use()``
allocates too little to trigger it; a first decision that reads a store does. Every round therefore measures the
pair twice: cold (the debt stays where it falls) and with ``gc.collect()`` after the imports in both processes (the
debt paid before either call), and both are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import gc, json, sys, time
inside = sys.argv[1] == "inside"
import torch
start = time.perf_counter()
import registry
imported = time.perf_counter() - start
if sys.argv[2] == "debt-paid":
    gc.collect()
x = torch.randn(4, 5)
index = torch.tensor([0, 2])
def call():
    return torch.func.vmap(lambda row: torch.index_fill(row, 0, index, 1.0))(x)
start, cpu = time.perf_counter(), time.process_time()
if inside:
    with registry.use():
        call()
else:
    call()
print(json.dumps({"import_s": imported, "call_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                  "modules": len(sys.modules)}))
"""


def _run(where: str, collector: str, env: dict[str, str]) -> dict[str, float]:
    finished = subprocess.run([sys.executable, "-c", PROBE, where, collector], capture_output=True, text=True, env=env,
                              check=True, timeout=300)
    return json.loads(finished.stdout.splitlines()[-1])


def measure(rounds: int, store: bool, collector: str = "cold") -> dict[str, float]:
    """Medians over ``rounds`` alternating fresh processes, in milliseconds (and the module counts)."""
    with tempfile.TemporaryDirectory() as folder:
        env = {k: v for k, v in os.environ.items() if k != "MULTICOMPOSITE_DB"}
        env["XDG_DATA_HOME"] = folder
        if store:
            from registry.store.evidence_store import EvidenceStore

            url = f"sqlite:///{Path(folder) / 'store.db'}"
            EvidenceStore(url).close()
            env["MULTICOMPOSITE_DB"] = url
        outside, inside = [], []
        for _ in range(rounds):
            outside.append(_run("outside", collector, env))
            inside.append(_run("inside", collector, env))
    return {
        "import_registry_ms": statistics.median(r["import_s"] for r in outside + inside) * 1e3,
        "first_call_outside_ms": statistics.median(r["call_s"] for r in outside) * 1e3,
        "first_call_inside_ms": statistics.median(r["call_s"] for r in inside) * 1e3,
        "added_ms": statistics.median(i["call_s"] - o["call_s"] for i, o in zip(inside, outside, strict=True)) * 1e3,
        # CPU time: what the call itself computed, which other processes on the machine do not add to.
        "added_cpu_ms": statistics.median(i["cpu_s"] - o["cpu_s"] for i, o in zip(inside, outside, strict=True)) * 1e3,
        "modules_outside": statistics.median(r["modules"] for r in outside),
        "modules_inside": statistics.median(r["modules"] for r in inside),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--store", action="store_true", help="give both a store, so the routed call reads it")
    args = parser.parse_args()
    for collector in ("cold", "debt-paid"):
        result = measure(args.rounds, args.store, collector)
        print(f"{collector}: import registry {result['import_registry_ms']:.0f} ms; first call outside use() "
              f"{result['first_call_outside_ms']:.1f} ms, inside {result['first_call_inside_ms']:.1f} ms: "
              f"+{result['added_ms']:.1f} ms (target <= 50; CPU time +{result['added_cpu_ms']:.1f} ms); "
              f"modules loaded {result['modules_outside']:.0f} vs "
              f"{result['modules_inside']:.0f}")


if __name__ == "__main__":
    main()
