"""flex_attention under vmap inside use(): the vmap dimensions fold into its batch dimension, and the score mod, the
block mask's mask mod and the tensors they capture see each sample's batch index. Natively vmap refuses it (the HOP
has no vmap rule). Forward only: PyTorch 2.13 has no flex_attention backward on CPU, natively too."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import func
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import registry

pytestmark = pytest.mark.usefixtures("routing_backend")

V, B, H, L, E = 3, 2, 2, 16, 8
generator = torch.Generator().manual_seed(0)
Q, K, VALUE = (torch.randn(V, B, H, L, E, dtype=torch.float64, generator=generator) for _ in range(3))
BIAS = torch.randn(B, H, dtype=torch.float64, generator=generator)
SAMPLE_BIAS = torch.randn(V, B, H, dtype=torch.float64, generator=generator)


def score_mod(score, b, h, m, n):
    return score + BIAS[b, h] + (m - n) * 0.01


def causal_except_first(b, h, m, n):
    return (m >= n) | (b == 0)  # the batch index decides: a wrong fold would show


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def attention(q, k, v):
    block_mask = create_block_mask(causal_except_first, B, H, L, L, device="cpu", BLOCK_SIZE=8)
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


def test_native_vmap_refuses() -> None:
    with pytest.raises(Exception, match="flex_attention"):
        func.vmap(attention)(Q, K, VALUE)


def test_vmap_folds_into_the_batch_dimension() -> None:
    expected = torch.stack([attention(Q[i], K[i], VALUE[i]) for i in range(V)])
    with registry.use():
        torch.testing.assert_close(func.vmap(attention)(Q, K, VALUE), expected)
        shared = func.vmap(attention, in_dims=(0, None, None))(Q, K[0], VALUE[0])
        moved = func.vmap(attention, in_dims=(2, 0, 0))(Q.movedim(0, 2), K, VALUE)
    torch.testing.assert_close(shared, torch.stack([attention(Q[i], K[0], VALUE[0]) for i in range(V)]))
    torch.testing.assert_close(moved, expected)


def test_captured_per_sample_tensors_and_two_levels() -> None:
    def biased(q, k, v, bias):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, m, n: s + bias[b, h])

    expected = torch.stack([biased(Q[i], K[i], VALUE[i], SAMPLE_BIAS[i]) for i in range(V)])
    with registry.use():
        torch.testing.assert_close(func.vmap(biased)(Q, K, VALUE, SAMPLE_BIAS), expected)
        nested = func.vmap(func.vmap(attention))(Q.unsqueeze(1).expand(V, 2, *Q.shape[1:]),
                                                 K.unsqueeze(1).expand(V, 2, *K.shape[1:]),
                                                 VALUE.unsqueeze(1).expand(V, 2, *VALUE.shape[1:]))
    torch.testing.assert_close(nested, torch.stack([torch.stack([attention(Q[i], K[i], VALUE[i])] * 2)
                                                    for i in range(V)]))


def test_log_sum_exp_and_a_block_mask_made_per_sample() -> None:
    """The auxiliary log-sum-exp unfolds too; a block mask built inside the vmapped function from a per-sample
    length (a padding mask) is batched itself and folds with the samples."""
    lengths = torch.tensor([5, 9, 16])

    def with_lse(q):
        out, aux = flex_attention(q, q, q, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def padded(q, length):
        block_mask = create_block_mask(lambda b, h, m, n: n < length, None, None, L, L, device="cpu", BLOCK_SIZE=8)
        return flex_attention(q, q, q, block_mask=block_mask)

    with registry.use():
        out, lse = func.vmap(with_lse)(Q)
        masked = func.vmap(padded)(Q, lengths)
    expected = [with_lse(Q[i]) for i in range(V)]
    torch.testing.assert_close(out, torch.stack([e[0] for e in expected]))
    torch.testing.assert_close(lse, torch.stack([e[1] for e in expected]))
    torch.testing.assert_close(masked, torch.stack([padded(Q[i], lengths[i]) for i in range(V)]))
