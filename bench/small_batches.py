"""``python -m bench.small_batches [--batches 4,16,64] [--rounds 5]``: use() against native at small batches.

Every ``python -m bench.models`` workload, and GPT-2 and BERT of the ``transformers`` library (tiny configs with
random weights, as in ``tests/models/test_transformers_library.py``; per-sample gradients through
``functional_call``, no attention mask), at each batch size: natively (torch.func alone) and inside
``registry.use()`` (an empty store, policy auto). One intra-op thread, timed in the calling thread's CPU time
(``time.thread_time``: time spent descheduled by other processes does not count), in interleaved rounds (native then
use(), the order swapped every round); each row reports the median over the rounds of the per-round ratio
native / use() (above 1: use() is faster). use()'s result is checked against native's first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import func, nn
from torch.utils._pytree import tree_flatten  # noqa: PLC2701 - PyTorch's pytree

import registry
from bench.models import Setup, Workload, all_workloads

TARGET = 0.97
LENGTH, VOCAB, LABELS = 16, 50, 3


def per_call_us(stmt: Callable[[], object], min_run_time: float) -> float:
    """Mean thread CPU time of one call over at least ``min_run_time`` seconds of it."""
    calls, start = 0, time.thread_time()
    while True:
        stmt()
        calls += 1
        elapsed = time.thread_time() - start
        if elapsed >= min_run_time:
            return elapsed / calls * 1e6


def _library(kind: str) -> Callable[[int], Setup]:
    """GPT-2 (causal LM loss) or BERT (sequence classification), per-sample gradients under vmap(grad)."""

    def build(batch: int) -> Setup:
        import transformers

        torch.manual_seed(0)
        if kind == "gpt2":
            config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                             eos_token_id=0)
            model: nn.Module = transformers.GPT2LMHeadModel(config)

            def inputs(ids: torch.Tensor, _labels: torch.Tensor) -> dict[str, Any]:
                return {"input_ids": ids, "labels": ids}
        else:
            config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64,
                                             max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0, num_labels=LABELS)
            model = transformers.BertForSequenceClassification(config)

            def inputs(ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
                return {"input_ids": ids, "labels": labels}
        model.train(False)  # inference mode: no dropout
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (batch, LENGTH), generator=generator)
        labels = torch.randint(0, LABELS, (batch,), generator=generator)
        params = {n: p.detach() for n, p in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return func.functional_call(model, p, (), inputs(x.unsqueeze(0), y.unsqueeze(0))).loss

        per_sample = func.vmap(func.grad(loss), in_dims=(None, 0, 0))
        return Setup(step=lambda: per_sample(params, ids, labels), loop=lambda: None)

    return build


def workloads() -> list[Workload]:
    found = list(all_workloads())
    try:
        import transformers  # noqa: F401
    except ImportError:
        return found
    return [*found, Workload("transformers-gpt2", "transformers library", _library("gpt2")),
            Workload("transformers-bert", "transformers library", _library("bert"))]


def equal_results(got: Any, want: Any, setup: Setup) -> bool:
    """Whether two results of a workload's step agree leaf by leaf, to the workload's tolerances."""
    got_leaves, _ = tree_flatten(got)
    want_leaves, _ = tree_flatten(want)
    return len(got_leaves) == len(want_leaves) and all(
        torch.allclose(g, w, rtol=setup.rtol, atol=setup.atol) for g, w in zip(got_leaves, want_leaves, strict=True))


def run(workload: Workload, batch: int, rounds: int, min_run_time: float) -> dict[str, Any]:
    setup = workload.build(batch)
    row: dict[str, Any] = {"workload": workload.name, "batch": batch}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            native = setup.step()
        except Exception as error:  # a workload that fails natively is reported, not timed
            row["status"] = f"native fails: {type(error).__name__}"
            return row
        with registry.use():
            routed = setup.step()
        if not equal_results(routed, native, setup):
            row["status"] = "use() differs from native"
            return row

        def inside() -> object:
            with registry.use():
                return setup.step()

        native_us, use_us = [], []
        for index in range(rounds):
            order = ((native_us, setup.step), (use_us, inside))
            for times, stmt in order if index % 2 == 0 else order[::-1]:
                times.append(per_call_us(stmt, min_run_time))
    ratios = [n / u for n, u in zip(native_us, use_us, strict=True)]
    row.update(status="ok", native_ms=statistics.median(native_us) / 1e3, use_ms=statistics.median(use_us) / 1e3,
               native_over_use=statistics.median(ratios))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.small_batches", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="4,16,64", help="comma-separated batch sizes (default 4,16,64)")
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="thread CPU seconds per timing (default 0.2)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{folder}/empty.db"  # a new user's empty store
        print(f"torch {torch.__version__}, 1 thread, thread CPU time, median of {args.rounds} interleaved rounds")
        print(f"{'workload':34} {'batch':>5} {'native ms':>10} {'use ms':>9} {'native/use':>10}")
        worst = float("inf")
        for workload in workloads():
            if args.only is not None and workload.name not in args.only:
                continue
            for batch in batches:
                row = run(workload, batch, args.rounds, args.min_run_time)
                if row["status"] != "ok":
                    print(f"{row['workload']:34} {batch:>5} {row['status']}")
                    continue
                worst = min(worst, row["native_over_use"])
                print(f"{row['workload']:34} {batch:>5} {row['native_ms']:>10.2f} {row['use_ms']:>9.2f} "
                      f"{row['native_over_use']:>9.2f}x", flush=True)
        print(f"worst native/use {worst:.2f}x (target >= {TARGET:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
