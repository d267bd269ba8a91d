"""Programs whose samples take different Python branches or shapes, under per-sample gradients inside use(): the
batch splits into groups of agreeing samples (registry.core.batch_split) and the result equals the per-sample loop.

- The ``transformers`` library's GPT-2 and BERT (tiny configs, random weights, nothing downloaded) with a 0/1 padding
  mask in which some sequences are padded and some not: the library's mask code asks ``if mask.all():`` in Python.
- A message-passing layer whose graphs differ in their self-loops: ``edge_index[:, edge_index[0] != edge_index[1]]``
  keeps a different number of edges per graph, then self-loops are added and messages scatter-added into a node
  tensor of fixed size, so the per-graph shapes agree again by the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import func, nn

import registry
from registry.core.batch_split import SPLITTER, BatchSplitWarning

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched: the models are built from configs

BATCH, LENGTH, VOCAB, LABELS = 4, 8, 50, 3
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
FALLBACK = "There is a performance drop"


@pytest.fixture(autouse=True)
def _split_warnings_apart() -> None:
    SPLITTER.forget_warnings()


def _gpt2(transformers: Any) -> tuple[nn.Module, Callable[..., dict[str, Any]]]:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), lambda ids, mask, _: {"input_ids": ids, "attention_mask": mask,
                                                                      "labels": ids}


def _bert(transformers: Any) -> tuple[nn.Module, Callable[..., dict[str, Any]]]:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=LABELS)
    return transformers.BertForSequenceClassification(config), lambda ids, mask, y: {
        "input_ids": ids, "attention_mask": mask, "labels": y}


MODELS = {"gpt2": _gpt2, "bert": _bert}
# Sequences 1 and 3 are padded (their last 3 and 5 positions), 0 and 2 are not.
MASK = torch.ones(BATCH, LENGTH, dtype=torch.long)
MASK[1, -3:] = 0
MASK[3, -5:] = 0


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_and_unpadded_sequences_per_sample_gradients_equal_the_loop(name: str,
                                                                           fallback_warnings: list) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, inputs = MODELS[name](transformers)
    model.eval()  # no dropout
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    labels = torch.randint(0, LABELS, (BATCH,), generator=generator)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return func.functional_call(model, p, (), inputs(x.unsqueeze(0), m.unsqueeze(0), y.unsqueeze(0))).loss

    with pytest.raises(RuntimeError):  # natively: the library's Python branch on the batched mask
        func.vmap(func.grad(loss), in_dims=(None, 0, 0, 0))(params, ids, MASK, labels)
    with registry.use():
        grads, values = func.vmap(func.grad_and_value(loss), in_dims=(None, 0, 0, 0))(params, ids, MASK, labels)
    splits = [w for w in fallback_warnings if issubclass(w.category, BatchSplitWarning)]
    assert splits, "some sequences are padded and some not: the batch splits"
    # Under auto, native's loop over the fused attention kernel may be the choice by cost at these small sizes
    # (registry/core/cost.py); nothing else loops.
    looped = {str(w.message).split("batching rule for ")[1].split(".")[0] for w in fallback_warnings
              if FALLBACK in str(w.message)}
    assert looped <= {"aten::_scaled_dot_product_flash_attention_for_cpu",
                      "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    for b in range(BATCH):
        model.zero_grad(set_to_none=True)
        out = model(**inputs(ids[b:b + 1], MASK[b:b + 1], labels[b:b + 1])).loss
        out.backward()
        torch.testing.assert_close(values[b], out.detach(), **TOLERANCE)
        for n, p in model.named_parameters():
            want = torch.zeros_like(p) if p.grad is None else p.grad
            torch.testing.assert_close(grads[n][b], want, **TOLERANCE, msg=lambda m, n=n: f"{n}: {m}")


# --- graphs that differ in their self-loops --------------------------------------------------------------------------

NODES, EDGES, FEATURES, HIDDEN, CLASSES = 6, 10, 4, 5, 3


class SelfLoopGCN(nn.Module):
    """A graph convolution as graph libraries write it: remove the self-loops present, add one per node, normalize by
    degree, scatter-add the messages into a fresh node tensor (``index_add_``), pool, classify."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        nodes = x.shape[0]
        edge_index = edge_index[:, edge_index[0] != edge_index[1]]  # a different number of edges per graph
        loops = torch.arange(nodes).expand(2, nodes)
        row, col = torch.cat([edge_index, loops], dim=1)
        degree = x.new_zeros(nodes).scatter_add_(0, col, torch.ones(col.shape[0], dtype=x.dtype))
        norm = degree.rsqrt()[row] * degree.rsqrt()[col]
        message = self.lin(x)[row] * norm.unsqueeze(-1)
        hidden = torch.zeros(nodes, HIDDEN, dtype=x.dtype).index_add_(0, col, message)  # fixed shape again
        return self.head(torch.tanh(hidden).mean(0))


def _self_loop_graphs(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(batch, NODES, FEATURES, dtype=torch.float64, generator=generator)
    src = torch.randint(0, NODES, (batch, EDGES), generator=generator)
    dst = (src + torch.randint(1, NODES, (batch, EDGES), generator=generator)) % NODES  # no self-loops ...
    edge_index = torch.stack([src, dst], dim=1)
    for graph in range(batch):  # ... then give graph g exactly g % 3 of them
        for k in range(graph % 3):
            edge_index[graph, :, k] = k
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    return x, edge_index, y


def test_graphs_differing_in_self_loops_per_sample_gradients_equal_the_loop(fallback_warnings: list) -> None:
    torch.manual_seed(0)
    model = SelfLoopGCN().double()
    x, edge_index, y = _self_loop_graphs(6)
    loops = (edge_index[:, 0] == edge_index[:, 1]).sum(-1)
    assert len(set(loops.tolist())) == 3  # the graphs differ in their self-loops
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], v: torch.Tensor, e: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = func.functional_call(model, p, (v, e))
        return nn.functional.cross_entropy(logits.unsqueeze(0), label.unsqueeze(0))

    with pytest.raises(RuntimeError):  # natively: boolean-mask indexing of a batched mask
        func.vmap(func.grad(loss), in_dims=(None, 0, 0, 0))(params, x, edge_index, y)
    with registry.use():
        grads = func.vmap(func.grad(loss), in_dims=(None, 0, 0, 0))(params, x, edge_index, y)
    splits = [str(w.message) for w in fallback_warnings if issubclass(w.category, BatchSplitWarning)]
    assert len(splits) == 1 and "into 3 groups" in splits[0]
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []
    for b in range(len(x)):
        model.zero_grad(set_to_none=True)
        loss(dict(model.named_parameters()), x[b], edge_index[b], y[b]).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n][b], p.grad, rtol=1e-12, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
