"""composites/index.py: where the index family's composites replace PyTorch's own op (NOTE [index_add's batched
index])."""

from __future__ import annotations

import torch
from torch.func import grad, vmap

import registry
from registry.harness.fallback import KernelCalls

NODES, EDGES, FEATURES, BATCH = 6, 9, 4, 5


def _aggregate(messages: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A graph layer's sum of messages into a fresh buffer, then a loss."""
    return (torch.zeros(NODES, FEATURES, dtype=messages.dtype).index_add(0, target, messages) * weight).sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    messages = torch.randn(BATCH, EDGES, FEATURES, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, NODES, (BATCH, EDGES), generator=generator)
    return messages, targets, torch.randn(NODES, FEATURES, generator=generator, dtype=torch.float64)


def test_index_add_with_a_batched_index_runs_one_scatter_add_inside_use() -> None:
    """Natively functorch calls index_add once per sample; inside use() one batched scatter_add, and the per-sample
    gradients equal autograd's one sample at a time."""
    messages, targets, weight = _inputs()
    step = vmap(grad(_aggregate), in_dims=(0, 0, None))
    with KernelCalls() as native_calls:
        step(messages, targets, weight)
    with registry.use(record=True) as block, KernelCalls() as routed_calls:
        result = step(messages, targets, weight)
    assert native_calls.of("index_add") == BATCH
    assert routed_calls.of("index_add") == 0
    assert routed_calls.of("scatter_add") == 1
    assert [(d.op, d.kind) for d in block.decisions] == [("index_add", "functional")]
    for b in range(BATCH):
        sample = messages[b].clone().requires_grad_()
        (expected,) = torch.autograd.grad(_aggregate(sample, targets[b], weight), sample)
        torch.testing.assert_close(result[b], expected)


def test_index_add_with_an_unbatched_index_stays_native() -> None:
    """The index the samples share: functorch's rule makes one call, and PyTorch's op is kept."""
    messages, targets, weight = _inputs()
    with registry.use(record=True) as block:
        vmap(grad(_aggregate), in_dims=(0, None, None))(messages, targets[0], weight)
    assert [(d.op, d.kind) for d in block.decisions] == [("index_add", "native")]
