"""Activation checkpointing under torch.func transforms inside use(): both forms of ``torch.utils.checkpoint`` and
``checkpoint_sequential`` equal the un-checkpointed program's per-sample loop (values and gradients, float64); each
choice is in the decision log. Natively every one of these stacks fails."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import func
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import registry
from registry.core import legacy_functions

pytestmark = pytest.mark.usefixtures("routing_backend")

torch.manual_seed(0)
W = torch.randn(4, 4, dtype=torch.float64)
BATCH = torch.randn(3, 4, dtype=torch.float64)
SEQUENTIAL = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh())
SEQUENTIAL.double()
LABELS = {True: "CheckpointFunction", False: "torch.utils.checkpoint (use_reentrant=False)"}


def block(x: torch.Tensor) -> torch.Tensor:
    return (x @ W).tanh() @ W


def plain(x: torch.Tensor) -> torch.Tensor:
    return block(x).sin().sum() + SEQUENTIAL(x).sum()


def checkpointed(reentrant: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        return (checkpoint(block, x, use_reentrant=reentrant).sin().sum()
                + checkpoint_sequential(SEQUENTIAL, 2, x, use_reentrant=reentrant).sum())

    return loss


def loop_grads(x: torch.Tensor) -> torch.Tensor:
    rows = []
    for sample in x:
        sample = sample.clone().requires_grad_()
        rows.append(torch.autograd.grad(plain(sample), sample)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_under_transforms_equals_the_loop(reentrant: bool) -> None:
    f = checkpointed(reentrant)
    expected_grads = loop_grads(BATCH)
    with registry.use():
        values = func.vmap(f)(BATCH)
        grads = func.vmap(func.grad(f))(BATCH)
        one = func.grad(f)(BATCH[0])
        jacobian = func.jacrev(lambda x: func.vmap(f)(x))(BATCH)
    torch.testing.assert_close(values, torch.stack([plain(x) for x in BATCH]))
    torch.testing.assert_close(grads, expected_grads)
    torch.testing.assert_close(one, expected_grads[0])
    # jacrev of the batch's losses: sample b's gradient at [b, b], zeros elsewhere.
    expected_jacobian = torch.zeros(len(BATCH), *BATCH.shape, dtype=torch.float64)
    rows = torch.arange(len(BATCH))
    expected_jacobian[rows, rows] = expected_grads
    torch.testing.assert_close(jacobian, expected_jacobian)
    chosen = {(d.function, d.stack): d.composite for d in legacy_functions.decisions()}
    for stack in ("vmap", "vmap(grad)", "grad"):
        assert chosen[(LABELS[reentrant], stack)] == "keep activations"


@pytest.mark.parametrize("reentrant", [True, False])
def test_natively_every_transform_refuses(reentrant: bool) -> None:
    f = checkpointed(reentrant)
    with pytest.raises(RuntimeError, match="setup_context" if reentrant else "saved tensor hooks"):
        func.vmap(func.grad(f))(BATCH)


def test_jvp_alone_recomputes_as_natively() -> None:
    f = checkpointed(False)
    tangent = torch.ones(4, dtype=torch.float64)
    expected = func.jvp(plain, (BATCH[0],), (tangent,))
    with registry.use():
        result = func.jvp(f, (BATCH[0],), (tangent,))
    torch.testing.assert_close(result, expected)
    chosen = {(d.function, d.stack): d.composite for d in legacy_functions.decisions()}
    assert chosen[(LABELS[False], "jvp")] == "recompute"


def test_user_requires_grad_under_a_transform() -> None:
    """What model libraries' checkpointing hooks call on their input embeddings: a no-op inside use() (grad still
    differentiates what it tracks); False still raises, as natively."""

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.requires_grad_(True)
        return (h * h).sum()

    with pytest.raises(RuntimeError, match="requires_grad_"):
        func.vmap(func.grad(f))(BATCH)
    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(f))(BATCH), 8 * BATCH)
        with pytest.raises(RuntimeError, match="requires_grad_"):
            func.grad(lambda x: (x * 2).requires_grad_(False).sum())(BATCH[0])
