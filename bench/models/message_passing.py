"""Message-passing graph networks, written the way graph libraries write them, under per-sample gradients.

Each sample is a graph of its own (node features and edges). The layers scatter the way graph-network libraries do:
the degree normalization ``edge_weight.new_zeros(n).scatter_add_(0, col, edge_weight)`` over the edge weights, which
are the same for every sample while the edges differ; the aggregation ``out.index_add_(0, index, msg)`` into
``torch.zeros`` and ``x.new_zeros(...).scatter_add_(...)``. Natively vmap refuses the first two (a per-sample value
written into an unbatched fresh buffer); inside ``use()`` the level is functionalized automatically
(registry.core.functionalization).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from bench.models import Setup, Workload

NODES, EDGES, FEATURES, HIDDEN, CLASSES = 12, 30, 8, 16, 3


def scatter_sum(src: torch.Tensor, index: torch.Tensor, dim_size: int, inplace: bool = True) -> torch.Tensor:
    """Sum the rows of ``src`` into ``dim_size`` rows by ``index`` (a graph library's ``scatter(..., reduce="sum")``);
    ``inplace=False``: the out-of-place form a user could write instead (bench/functionalization.py compares)."""
    size = list(src.shape)
    size[0] = dim_size
    index = index.view(-1, *([1] * (src.dim() - 1))).expand_as(src)
    buffer = src.new_zeros(size)
    return buffer.scatter_add_(0, index, src) if inplace else buffer.scatter_add(0, index, src)


class GCNConv(nn.Module):
    """Kipf and Welling's graph convolution: self-loops, symmetric degree normalization, a sum of messages."""

    def __init__(self, in_features: int, out_features: int, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.lin = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        nodes = x.shape[0]
        loops = torch.arange(nodes, device=x.device)
        row = torch.cat([edge_index[0], loops])
        col = torch.cat([edge_index[1], loops])
        edge_weight = torch.ones(row.shape[0], dtype=x.dtype, device=x.device)
        degree = scatter_sum(edge_weight, col, nodes, self.inplace)
        inverse_sqrt = degree.pow(-0.5)
        norm = inverse_sqrt[row] * edge_weight * inverse_sqrt[col]
        h = self.lin(x)
        message = h[row] * norm.unsqueeze(-1)
        out = torch.zeros(nodes, h.shape[1], dtype=h.dtype, device=h.device)
        out = out.index_add_(0, col, message) if self.inplace else out.index_add(0, col, message)
        return out + self.bias


class GINConv(nn.Module):
    """Xu et al.'s graph isomorphism layer: an MLP of (1 + eps) x plus the sum of the neighbours' features."""

    def __init__(self, features: int, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.eps = nn.Parameter(torch.zeros(()))
        self.mlp = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, features))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        aggregated = scatter_sum(x[src], dst, x.shape[0], self.inplace)
        return self.mlp((1 + self.eps) * x + aggregated)


class GraphClassifier(nn.Module):
    """GCN, then GIN, mean pooling over the nodes, a linear head (``inplace=False``: the out-of-place scatters)."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.gcn = GCNConv(FEATURES, HIDDEN, inplace)
        self.gin = GINConv(HIDDEN, inplace)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.gcn(x, edge_index))
        h = self.gin(h, edge_index)
        return self.head(h.mean(0))


def graphs(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` random graphs: node features, edge lists (each sample its own) and a class per graph."""
    x = torch.randn(batch, NODES, FEATURES, generator=generator)
    edge_index = torch.randint(0, NODES, (batch, 2, EDGES), generator=generator)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    return x, edge_index, y


def per_sample_gradients(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor,
                         y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``vmap(grad(loss))`` through ``functional_call``: each graph's gradient of its cross-entropy."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xs: torch.Tensor, edges: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (xs, edges))
        return nn.functional.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, x, edge_index, y)


def loop_gradients(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor,
                   y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: one graph at a time, torch.autograd, no transform."""
    names = [name for name, _ in model.named_parameters()]
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for b in range(x.shape[0]):
        logits = model(x[b], edge_index[b])
        loss = nn.functional.cross_entropy(logits.unsqueeze(0), y[b].unsqueeze(0))
        for name, g in zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True):
            rows[name].append(g)
    return {name: torch.stack(values) for name, values in rows.items()}


def batched_step(model: GraphClassifier, x: torch.Tensor, edge_index: torch.Tensor, y: torch.Tensor) -> None:
    """One ordinary training step over the batch as one disjoint graph (what a graph library's batching makes)."""
    batch, nodes = x.shape[0], x.shape[1]
    offsets = (torch.arange(batch) * nodes).view(batch, 1, 1)
    edges = (edge_index + offsets).transpose(0, 1).reshape(2, -1)
    h = torch.relu(model.gcn(x.reshape(batch * nodes, -1), edges))
    h = model.gin(h, edges).view(batch, nodes, -1).mean(1)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model.head(h), y, reduction="sum").backward()


def _build(batch: int) -> Setup:
    torch.manual_seed(0)
    model = GraphClassifier()
    x, edge_index, y = graphs(batch, torch.Generator().manual_seed(1))
    args: tuple[Any, ...] = (model, x, edge_index, y)
    return Setup(step=lambda: per_sample_gradients(*args), loop=lambda: loop_gradients(*args),
                 batched=lambda: batched_step(*args))


WORKLOADS: list[Workload] = [Workload("gcn-gin-per-sample-grad", "message passing", _build)]
