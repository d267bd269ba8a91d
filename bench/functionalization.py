"""What automatic functionalization costs, measured side by side in one process (``python -m bench.functionalization``).

(f1) a ``vmap(grad(f))`` call that needs no functionalization, inside ``use()``: PyTorch's vmap implementation vs the
     functionalizing one (the code key, the RNG snapshot, a try): what every vmap call inside ``use()`` pays
(f2) the message-passing per-sample-gradient step (bench/models/message_passing.py, batch 64), three ways of making it
     run: inside ``use()`` (functionalized automatically, remembered); ``vmap(functionalize(grad(loss)))`` written by
     hand, outside ``use()``; the same model rewritten with out-of-place scatters (``scatter_add``, ``index_add``),
     natively
(f3) the first call of (f2) inside ``use()`` (the refused run, then the functionalized one) vs a remembered call
(f4) a write-heavy step: an integrator's per-sample gradients through a preallocated trajectory
     (``solution = torch.empty(T, d); solution[0] = y0; solution[t] = ...``, and the same with each step computed
     by ``torch.add(..., out=workspace)``) inside ``use()``, vs the same integrator written with ``torch.stack``
     natively (native cannot run the writing forms: vmap refuses the write; functionalized by hand, the backward
     reaches ``as_strided_scatter``, which has no batching rule, and autograd refuses ``out=``), vs a per-sample
     ``torch.autograd`` loop

Each pair is timed in alternating rounds, on one thread and its CPU time (what other processes do adds nothing); the
minimum over rounds is reported, since noise only ever adds time.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
import torch._functorch.vmap as functorch_vmap  # noqa: PLC2701 - functorch's internals have no public API
from torch import func, nn
from torch.func import functional_call
from torch.utils.benchmark import Timer

import registry
from bench.models.message_passing import GraphClassifier, graphs, per_sample_gradients
from registry.core import functionalization


def _ms(stmt: Callable[[], object], min_run_time: float) -> float:
    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=1, timer=time.thread_time)
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _rounds(stmts: dict[str, Callable[[], object]], rounds: int, min_run_time: float) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in stmts}
    for _ in range(rounds):
        for name, stmt in stmts.items():
            times[name].append(_ms(stmt, min_run_time))
    return {name: min(values) for name, values in times.items()}


def f1(rounds: int, min_run_time: float) -> None:
    weight = torch.randn(16, 16)
    x = torch.randn(8, 16)

    def loss(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.tanh(v @ w).sum()

    step = func.vmap(func.grad(loss), in_dims=(None, 0))
    implementations = {"pytorch": functionalization.PYTORCH_FLAT_VMAP,
                       "functionalizing": functionalization.functionalizing_flat_vmap}
    times: dict[str, list[float]] = {name: [] for name in implementations}
    with registry.use():
        try:
            # The first round warms up (measured: without it the implementation timed first looked faster).
            for round_number in range(rounds + 1):
                for name, implementation in implementations.items():
                    functorch_vmap._flat_vmap = implementation
                    elapsed = _ms(lambda: step(weight, x), min_run_time)
                    if round_number:
                        times[name].append(elapsed)
        finally:
            functorch_vmap._flat_vmap = functionalization.functionalizing_flat_vmap
    found = {name: min(values) for name, values in times.items()}
    added_us = (found["functionalizing"] - found["pytorch"]) * 1e3
    print(f"(f1) vmap(grad) needing nothing, inside use(): PyTorch's vmap {found['pytorch'] * 1e3:.1f} us, "
          f"functionalizing {found['functionalizing'] * 1e3:.1f} us ({added_us:+.1f} us, "
          f"{found['pytorch'] / found['functionalizing']:.3f}x)")


def f2_f3(batch: int, rounds: int, min_run_time: float) -> None:
    torch.manual_seed(0)
    model = GraphClassifier()
    rewritten = GraphClassifier(inplace=False)
    rewritten.load_state_dict(model.state_dict())
    x, edge_index, y = graphs(batch, torch.Generator().manual_seed(1))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xs: torch.Tensor, edges: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (xs, edges))
        return nn.functional.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))

    by_hand = func.vmap(func.functionalize(func.grad(loss)), in_dims=(None, 0, 0, 0))

    def automatic() -> object:
        with registry.use():
            return per_sample_gradients(model, x, edge_index, y)

    automatic()  # registers the kernels (and builds or loads the compiled ones) outside the timing
    functionalization.FUNCTIONALIZED.clear()
    start = time.perf_counter()
    automatic()
    first_ms = (time.perf_counter() - start) * 1e3
    found = _rounds({
        "automatic": automatic,
        "by_hand": lambda: by_hand(params, x, edge_index, y),
        "out_of_place": lambda: per_sample_gradients(rewritten, x, edge_index, y),
    }, rounds, min_run_time)
    print(f"(f2) message passing, per-sample gradients, batch {batch}: use() {found['automatic']:.2f} ms, "
          f"vmap(functionalize(grad)) by hand {found['by_hand']:.2f} ms "
          f"({found['by_hand'] / found['automatic']:.2f}x of use()), out-of-place rewrite natively "
          f"{found['out_of_place']:.2f} ms ({found['out_of_place'] / found['automatic']:.2f}x of use())")
    print(f"(f3) its first call inside use() (refused, then functionalized): {first_ms:.2f} ms, "
          f"{first_ms / found['automatic']:.2f}x a remembered call")


def _integrate(form: str, weight: torch.Tensor, y0: torch.Tensor, steps: int) -> torch.Tensor:
    """Explicit Euler steps of dy/dt = tanh(y W), the trajectory's mean square: into a preallocated buffer by index
    (``index``), by ``out=`` (``out``), or stacked out of place (``stack``)."""
    if form == "stack":
        states = [y0]
        for _ in range(1, steps):
            states.append(states[-1] + 0.1 * torch.tanh(states[-1] @ weight))
        return torch.stack(states).square().mean()
    solution = torch.empty(steps, *y0.shape)
    solution[0] = y = y0
    for step in range(1, steps):
        if form == "index":
            y = y + 0.1 * torch.tanh(y @ weight)
        else:  # a solver's workspace: each step's state computed into a buffer of its own
            y = torch.add(y, torch.tanh(y @ weight), alpha=0.1, out=torch.empty_like(y))
        solution[step] = y
    return solution.square().mean()


def f4(batch: int, rounds: int, min_run_time: float, steps: int = 20, width: int = 16) -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(width, width, generator=generator) / width ** 0.5
    y0 = torch.randn(batch, width, generator=generator)

    def step(form: str) -> Callable[[], object]:
        grads = func.vmap(func.grad(lambda w, y: _integrate(form, w, y, steps)), in_dims=(None, 0))
        if form == "stack":
            return lambda: grads(weight, y0)

        def inside() -> object:
            with registry.use():
                return grads(weight, y0)

        return inside

    def loop() -> object:
        leaf = weight.clone().requires_grad_()
        return torch.stack([torch.autograd.grad(_integrate("index", leaf, y, steps), leaf)[0] for y in y0])

    stmts = {"index": step("index"), "out": step("out"), "stack": step("stack"), "loop": loop}
    expected = loop()
    for name in ("index", "out", "stack"):
        torch.testing.assert_close(stmts[name](), expected)  # also registers and remembers outside the timing
    found = _rounds(stmts, rounds, min_run_time)
    print(f"(f4) integrator per-sample gradients, {steps} steps of width {width}, batch {batch}: use() with index "
          f"writes {found['index']:.2f} ms, with out= {found['out']:.2f} ms; torch.stack natively "
          f"{found['stack']:.2f} ms (use() {found['index'] / found['stack']:.2f}x / "
          f"{found['out'] / found['stack']:.2f}x of it); per-sample torch.autograd loop {found['loop']:.2f} ms "
          f"({found['loop'] / found['index']:.1f}x of use())")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.functionalization", description=__doc__)
    parser.add_argument("--batch", type=int, default=64, help="graphs per step in (f2) and (f3) (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default 5)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing (default 0.2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, CPU time of the calling thread")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f1(args.rounds, args.min_run_time)
        f2_f3(args.batch, args.rounds, args.min_run_time)
        f4(args.batch, args.rounds, args.min_run_time)


if __name__ == "__main__":
    main()
