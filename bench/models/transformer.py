"""Transformer workloads: per-sample gradients of a 2-layer ``nn.TransformerEncoder`` (its attention is
``F.scaled_dot_product_attention``) over padded sequences, and of a single ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention``, through ``torch.func.functional_call``: ``vmap(grad(loss))`` against a per-sample
``torch.autograd`` loop."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import func, nn

from bench.models import Setup, Workload

WIDTH, HEADS, FEEDFORWARD, LENGTH, CLASSES = 64, 4, 128, 32, 10


class Classifier(nn.Module):
    """An encoder over padded sequences, mean-pooled over the real positions, then a linear head."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(tokens, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` without weights returned (its SDPA path), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        out, _ = self.attention(tokens, tokens, tokens, key_padding_mask=padding, need_weights=False)
        return self.head(out.mean(1))


def padded_batch(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, padding mask, labels): each sequence has its own length, 8 to LENGTH positions; True is padding."""
    tokens = torch.randn(batch, LENGTH, WIDTH, generator=generator)
    lengths = torch.randint(8, LENGTH + 1, (batch,), generator=generator)
    padding = torch.arange(LENGTH).unsqueeze(0) >= lengths.unsqueeze(1)
    labels = torch.randint(0, CLASSES, (batch,), generator=generator)
    return tokens, padding, labels


def per_sample_gradients(make: Callable[[], nn.Module]) -> Callable[[int], Setup]:
    """A workload builder: ``vmap(grad(loss))`` of one sample's cross entropy, and the per-sample loop."""

    def build(batch: int) -> Setup:
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = make().train(False)  # evaluation mode: no dropout; the fast path stays off because gradients are taken
        params = {name: p.detach() for name, p in model.named_parameters()}
        tokens, padding, labels = padded_batch(batch, generator)

        def loss(p: dict[str, torch.Tensor], x: torch.Tensor, pad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = func.functional_call(model, p, (x.unsqueeze(0), pad.unsqueeze(0)))
            return nn.functional.cross_entropy(logits, y.unsqueeze(0))

        per_sample = func.vmap(func.grad(loss), in_dims=(None, 0, 0, 0))

        def step() -> dict[str, torch.Tensor]:
            return per_sample(params, tokens, padding, labels)

        def loop() -> dict[str, torch.Tensor]:
            grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
            for b in range(batch):
                model.zero_grad(set_to_none=True)
                logits = model(tokens[b:b + 1], padding[b:b + 1])
                nn.functional.cross_entropy(logits, labels[b:b + 1]).backward()
                for name, p in model.named_parameters():
                    grads[name].append(p.grad.clone())
            return {name: torch.stack(each) for name, each in grads.items()}

        def batched() -> None:
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(tokens, padding), labels, reduction="sum").backward()

        return Setup(step=step, loop=loop, batched=batched, rtol=1e-4, atol=1e-5)

    return build


WORKLOADS: list[Workload] = [
    Workload("transformer-2layer-sdpa-padding", "transformer", per_sample_gradients(lambda: Classifier(2))),
    Workload("transformer-encoder-layer", "transformer", per_sample_gradients(lambda: Classifier(1))),
    Workload("multihead-attention-sdpa", "transformer", per_sample_gradients(Attention)),
]
