"""``python -m bench.crossovers [--op OP ...] [--batches 4,16,64]``: where a composite loses to PyTorch's own op.

Every covered op (or the ``--op`` ones) on its OpInfo sample, under vmap and vmap(grad), at each batch size: native
and each composite timed side by side by ``registry.profiling.timing.profile`` (one thread, thread CPU time,
interleaved rounds), nothing stored. A row is printed where the fastest composite is slower than native by more
than the noise: the candidates for a size signature (``define_op(..., sizes=...)``, docs/profiles.md), where
PyTorch's op only loops there and the rules pick the composite. Where PyTorch's op has a batching rule ``auto``
runs it anyway, so such a row is not a loss inside ``use()``: ``registry.select`` tells which.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from registry.core.ratios import MIN_NOISE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.crossovers", description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", dest="ops", help="an op (repeatable; default: every covered op)")
    parser.add_argument("--batches", default="4,16,64", help="batch sizes, comma-separated (default 4,16,64)")
    parser.add_argument("--min-run-time", type=float, default=0.03, help="thread CPU seconds per context")
    args = parser.parse_args(argv)
    import registry
    from registry.profiling.timing import profile

    registry.load()
    torch.set_num_threads(1)
    refused: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = profile(ops=args.ops, workloads=["vmap", "vmap(grad)"],
                          batch_sizes=tuple(int(b) for b in args.batches.split(",")), min_run_time=args.min_run_time,
                          rounds=3, refused=refused, clock=time.thread_time)
    contexts: dict[tuple[str, str, int, int], dict[str, float]] = {}
    for entry in entries:
        if entry.valid and entry.median_us:
            key = (entry.op, entry.workload, entry.batch_size, entry.numel_bucket)
            contexts.setdefault(key, {})[entry.composite] = entry.median_us
    print(f"{'op':40s} {'workload':10s} {'batch':>5s} {'numel':>6s} {'native us':>10s} {'best':>22s} native/best")
    for (op, workload, batch, numel), times in sorted(contexts.items()):
        native = times.get("native")
        others = {name: us for name, us in times.items() if name != "native"}
        if native is None or not others:
            continue
        best = min(others, key=others.__getitem__)
        if native / others[best] < 1 / (1 + MIN_NOISE):
            print(f"{op:40s} {workload:10s} {batch:5d} {numel:6d} {native:10.0f} {best:>15s} {others[best]:6.0f} "
                  f"{native / others[best]:10.2f}x", flush=True)
    print(f"{len(contexts)} contexts timed; {len(refused)} refused (no sample the workload can run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
