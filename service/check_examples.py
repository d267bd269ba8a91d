"""The built-in programs that ``POST /checks`` runs: small real workloads shipped with the package.

A check job names one of these, never code: a server must not execute what a request sends it, nor import a module
a request names (a path on the server's disk is code someone put there, and a request would choose which runs).
Users check their own code on their own machine with ``multicomposite check file.py:function`` or
``registry.check``; the service offers the same report for the programs below, built at small sizes so that a job
takes seconds. Each builds its model and data from a fixed seed, nothing downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Example:
    """One program to check: ``build()`` gives the per-sample function and its batched example arguments."""

    name: str
    description: str
    transform: str
    in_dims: tuple[int | None, ...]
    argnums: int
    build: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
    needs: str | None = None  # a library the example imports beyond torch (its extra), or None


def _index_fill() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    base, index = torch.zeros(5, 4), torch.tensor([0, 2])

    def f(x: torch.Tensor) -> torch.Tensor:  # fills an unbatched tensor with a value computed from the sample
        return (base.index_fill(0, index, x.sum()) * x).pow(2).sum()

    return f, (torch.randn(8, 5, 4, generator=torch.Generator().manual_seed(0)),)


def _params(model: Any) -> dict[str, Any]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _mlp() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 10, generator=generator), torch.randint(0, 3, (16,), generator=generator)

    def loss(params: dict[str, torch.Tensor], sample: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (sample.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, target.unsqueeze(0))

    return loss, (_params(model), x, y)


def _lstm() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn
    from torch.func import functional_call

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(6, 12)
            self.head = nn.Linear(12, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(x)[0][-1])

    torch.manual_seed(0)
    model = Classifier()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 7, 6, generator=generator), torch.randint(0, 2, (6,), generator=generator)

    def loss(params: dict[str, torch.Tensor], sequence: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (sequence,))
        return nn.functional.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))

    return loss, (_params(model), x, y)


def _gcn() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn
    from torch.func import functional_call

    nodes, edges, features, hidden, classes = 10, 24, 6, 12, 3

    class GCN(nn.Module):
        """One graph convolution written as graph libraries write it: a sum of messages into a fresh buffer."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(features, hidden)
            self.head = nn.Linear(hidden, classes)

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            row, col = edge_index
            degree = torch.ones(x.shape[0]).index_add_(0, col, torch.ones(col.shape[0]))
            message = self.lin(x)[row] / degree[col].unsqueeze(-1)
            out = torch.zeros(x.shape[0], hidden).index_add_(0, col, message)
            return self.head(torch.relu(out).mean(0))

    torch.manual_seed(0)
    model = GCN()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, nodes, features, generator=generator)
    edge_index = torch.randint(0, nodes, (5, 2, edges), generator=generator)
    y = torch.randint(0, classes, (5,), generator=generator)

    def loss(params: dict[str, torch.Tensor], xs: torch.Tensor, graph: torch.Tensor,
             target: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (xs, graph))
        return nn.functional.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))

    return loss, (_params(model), x, edge_index, y)


def _pinn() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    from torch import nn
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    points = torch.rand(12, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def u(params: dict[str, torch.Tensor], point: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (point,)).squeeze()

    return u, (_params(model), points)


def _gpt2() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import os

    import torch
    from torch.func import functional_call

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched: the model is built from a config
    import transformers

    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train(False)
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))

    def loss(params: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        batch = sample.unsqueeze(0)
        return functional_call(model, params, (), {"input_ids": batch, "labels": batch}).loss

    return loss, (_params(model), ids)


EXAMPLES: dict[str, Example] = {example.name: example for example in (
    Example("index-fill", "the README's example: index_fill of a value computed from the sample into an unbatched "
            "tensor, per-sample gradients (PyTorch 2.13 alone returns wrong values)", "vmap(grad)", (0,), 0,
            _index_fill),
    Example("mlp-per-sample-grads", "DP-SGD's per-sample gradients of a two-layer MLP's cross-entropy through "
            "functional_call", "vmap(grad)", (None, 0, 0), 0, _mlp),
    Example("lstm-per-sample-grads", "per-sample gradients of an LSTM sequence classifier", "vmap(grad)",
            (None, 0, 0), 0, _lstm),
    Example("gcn-per-sample-grads", "per-sample gradients of a graph convolution whose messages are summed into a "
            "fresh buffer with index_add_", "vmap(grad)", (None, 0, 0, 0), 0, _gcn),
    Example("pinn-hessian", "a physics-informed network's second derivatives in its inputs (the Laplacian's "
            "terms), per collocation point", "vmap(hessian)", (None, 0), 1, _pinn),
    Example("gpt2-per-sample-grads", "per-sample gradients of the transformers library's GPT-2 (a tiny config, "
            "random weights)", "vmap(grad)", (None, 0), 0, _gpt2, needs="transformers"),
)}
