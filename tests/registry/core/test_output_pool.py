"""The output pool (``registry/core/kernels/output_pool.cpp``): the per-sample gradients that linear's batching rule
and the embedding backward's write are the pool's blocks; a block freed goes back to the pool and the next call of
its size gets it again; ``empty_output_pool`` frees the idle blocks; ``MULTICOMPOSITE_OUTPUT_POOL_MB`` bounds the idle
bytes, 0 turns the pool off, and anything but a whole number is refused with what to set."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from torch import func
from torch.nn import functional

import registry
from registry.core import routing

BATCH, TABLE_ROWS, WIDTH, IN, OUT = 6, 40, 8, 16, 12
TABLE_BYTES = BATCH * TABLE_ROWS * WIDTH * 4  # float32 (B, rows, D)
WEIGHT_BYTES = BATCH * OUT * IN * 4  # float32 (B, out, in)


@pytest.fixture
def pool(compiled_kernels: ModuleType) -> object:
    """The pool's two ops, with the C++ routing in use (the batching rules are the C++ backend's)."""
    routing.set_routing_backend("cpp")
    torch.ops.multicomposite.empty_output_pool()
    return torch.ops.multicomposite


def _held() -> tuple[int, int]:
    """(idle bytes, all bytes) the pool holds."""
    idle, total = torch.ops.multicomposite.output_pool_bytes()
    return idle, total


def _embedding_step() -> Callable[[], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(TABLE_ROWS, WIDTH, generator=generator)
    indices = torch.randint(0, TABLE_ROWS, (BATCH, 5), generator=generator)

    def loss(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return functional.embedding(i, w).tanh().sum()

    return lambda: func.vmap(func.grad(loss), in_dims=(None, 0))(weight, indices)


def _linear_step() -> Callable[[], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(IN, OUT)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    x = torch.randn(BATCH, IN, generator=generator)

    def loss(p: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, p, (sample,)).tanh().sum()

    return lambda: func.vmap(func.grad(loss), in_dims=(None, 0))(params, x)


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize(("step", "block_bytes"), ((_embedding_step, TABLE_BYTES), (_linear_step, WEIGHT_BYTES)),
                         ids=("embedding", "linear"))
def test_per_sample_gradients_come_from_the_pool_and_go_back(step: Callable[[], Callable[[], object]],
                                                              block_bytes: int) -> None:
    run = step()
    idle_before, total_before = _held()
    with registry.use():
        result = run()
    idle, total = _held()
    assert (idle, total - total_before) == (idle_before, block_bytes)  # one new block, in use
    del result
    assert _held() == (idle_before + block_bytes, total)  # back in the pool, still mapped
    with registry.use():
        again = run()
    assert _held() == (idle_before, total)  # the same block again: nothing new
    del again
    torch.ops.multicomposite.empty_output_pool()
    assert _held() == (0, total - idle_before - block_bytes)


@pytest.mark.usefixtures("pool")
def test_nothing_comes_from_the_pool_outside_use() -> None:
    """Outside use() (and under policy "native") PyTorch's rules run and the pool makes nothing."""
    run = _embedding_step()
    before = _held()
    kept = [run()]
    with registry.use(policy="native"):
        kept.append(run())
    assert _held() == before


def _pool_in_a_process(limit: str) -> subprocess.CompletedProcess[str]:
    script = ("import torch, registry\n"
              "from tests.registry.core.test_output_pool import _embedding_step\n"
              "run = _embedding_step()\n"
              "with registry.use():\n"
              "    result = run()\n"
              "in_use = torch.ops.multicomposite.output_pool_bytes()\n"
              "del result\n"
              "print(*in_use, *torch.ops.multicomposite.output_pool_bytes())\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MULTICOMPOSITE_OUTPUT_POOL_MB": limit})


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize(("limit", "held"), (("0", "0 0 0 0"), ("1", f"0 {TABLE_BYTES} {TABLE_BYTES} {TABLE_BYTES}")),
                         ids=("off", "one-megabyte"))
def test_the_limit_bounds_the_idle_bytes(limit: str, held: str) -> None:
    """0 turns the pool off (PyTorch's allocator makes the tables); a block within the limit stays idle after use."""
    done = _pool_in_a_process(limit)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == held


@pytest.mark.usefixtures("compiled_kernels")
def test_a_block_past_the_limit_goes_back_to_the_system() -> None:
    script = ("import torch, registry\n"
              "from torch import func\n"
              "weight, indices = torch.randn(3000, 64), torch.randint(0, 3000, (8, 5))\n"  # 8 x 3000 x 64 x 4: 6 MB
              "def loss(w, i):\n"
              "    return torch.nn.functional.embedding(i, w).sum()\n"
              "with registry.use():\n"
              "    result = func.vmap(func.grad(loss), in_dims=(None, 0))(weight, indices)\n"
              "del result\n"
              "print(*torch.ops.multicomposite.output_pool_bytes())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MULTICOMPOSITE_OUTPUT_POOL_MB": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "0 0"


@pytest.mark.usefixtures("compiled_kernels")
def test_a_limit_that_is_not_a_number_says_what_to_set() -> None:
    done = _pool_in_a_process("lots")
    assert done.returncode == 1
    assert ("MULTICOMPOSITE_OUTPUT_POOL_MB must be a whole number of megabytes (got 'lots'); unset it for the default "
            "of 1024, or set 0 to turn the pool off") in done.stderr


@pytest.mark.usefixtures("pool")
def test_the_profiler_sees_the_pools_blocks() -> None:
    """torch.profiler's profile_memory counts a pooled block as PyTorch's own allocator's: the embedding backward
    that takes it shows its bytes."""
    run = _embedding_step()
    with registry.use(), torch.profiler.profile(profile_memory=True) as profile:
        result = run()
    taken = [event.cpu_memory_usage for event in profile.events() if event.name == "aten::embedding_dense_backward"]
    assert TABLE_BYTES in taken
    del result


@pytest.mark.usefixtures("pool")
def test_an_empty_table_takes_nothing() -> None:
    """A table of no rows (num_weights 0 is refused by embedding itself; an empty width is not) holds no block."""
    weight, indices = torch.randn(TABLE_ROWS, 0), torch.randint(0, TABLE_ROWS, (BATCH, 5))
    before = _held()
    with registry.use():
        result = func.vmap(func.grad(lambda w, i: functional.embedding(i, w).sum()), in_dims=(None, 0))(weight, indices)
    assert result.shape == (BATCH, TABLE_ROWS, 0)
    assert _held() == before


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("length", [1 << 21, 100], ids=["streamed", "small"])
def test_zeroing_with_streaming_stores_writes_exactly_the_block(length: int) -> None:
    """A block of 8 MiB is zeroed with streaming stores, a small one with zero_(); a view that starts off a 32-byte
    boundary and ends off one is zeroed from its first element to its last, and nothing around it."""
    data = torch.randn(length + 3)
    inside = data[1:-2]
    assert inside.data_ptr() % 32 != 0
    torch.ops.multicomposite.zero_streaming_(inside)
    assert torch.count_nonzero(inside) == 0
    assert bool((data[:1] != 0).all() and (data[-2:] != 0).all())


@pytest.mark.usefixtures("pool")
def test_large_tables_are_zeroed_and_filled_as_the_loop() -> None:
    """Per-sample tables of 4 MiB and more (zeroed with streaming stores) equal the per-sample loop's."""
    generator = torch.Generator().manual_seed(2)
    weight, indices = torch.randn(3000, 64, generator=generator), torch.randint(0, 3000, (8, 5), generator=generator)

    def loss(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return functional.embedding(i, w).tanh().sum()

    with registry.use():
        got = func.vmap(func.grad(loss), in_dims=(None, 0))(weight, indices)
    assert got.numel() * 4 >= 4 << 20
    for sample, each in zip(indices, got, strict=True):
        leaf = weight.clone().requires_grad_()
        torch.testing.assert_close(each, torch.autograd.grad(loss(leaf, sample), leaf)[0])
