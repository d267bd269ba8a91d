"""Per-sample-gradient steps of recurrent sequence classifiers: ``nn.GRU`` and ``nn.LSTM`` encoders, a linear head
on the last step, cross-entropy, ``vmap(grad)`` through ``functional_call`` (float32, CPU).

Natively the GRU step raises (a shape error inside PyTorch's own GRU decomposition) and the LSTM step runs vmap's
per-sample loop over ``aten::mkldnn_rnn_layer``; inside ``use()`` both run ``composites.recurrent``'s batched cells.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from bench.models import Setup, Workload

STEPS, FEATURES, HIDDEN, CLASSES = 16, 32, 64, 4


class _Classifier(nn.Module):
    def __init__(self, recurrent: nn.Module, out_features: int) -> None:
        super().__init__()
        self.recurrent = recurrent
        self.head = nn.Linear(out_features, CLASSES)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        return self.head(self.recurrent(sequence)[0][-1])  # one unbatched (steps, features) sequence


def _build(kind: type[nn.Module], num_layers: int, bidirectional: bool) -> Callable[[int], Setup]:
    def build(batch: int) -> Setup:
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = _Classifier(kind(FEATURES, HIDDEN, num_layers=num_layers, bidirectional=bidirectional),
                            HIDDEN * (2 if bidirectional else 1))
        x = torch.randn(batch, STEPS, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (batch,), generator=generator)
        params = {name: p.detach() for name, p in model.named_parameters()}

        def loss(weights: dict[str, torch.Tensor], sample: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = functional_call(model, weights, (sample,))
            return nn.functional.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))

        per_sample_grad = vmap(grad(loss), in_dims=(None, 0, 0))

        def step() -> dict[str, torch.Tensor]:
            return per_sample_grad(params, x, y)

        def loop() -> dict[str, torch.Tensor]:
            leaves = [p for _, p in model.named_parameters()]
            grads = [torch.autograd.grad(nn.functional.cross_entropy(model(x[b]).unsqueeze(0), y[b:b + 1]), leaves)
                     for b in range(batch)]
            return {name: torch.stack(column) for (name, _), column in
                    zip(model.named_parameters(), zip(*grads, strict=True), strict=True)}

        def batched() -> None:  # the whole batch as (steps, batch, features)
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x.transpose(0, 1)), y, reduction="sum").backward()

        return Setup(step=step, loop=loop, batched=batched, rtol=1e-4, atol=1e-5)

    return build


WORKLOADS: list[Workload] = [
    Workload(name="gru-classifier", family="recurrent", build=_build(nn.GRU, 1, False)),
    Workload(name="gru-2layer-bi-classifier", family="recurrent", build=_build(nn.GRU, 2, True)),
    Workload(name="lstm-classifier", family="recurrent", build=_build(nn.LSTM, 1, False)),
    Workload(name="lstm-2layer-bi-classifier", family="recurrent", build=_build(nn.LSTM, 2, True)),
]
