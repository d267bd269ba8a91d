"""Message-passing layers written the way graph libraries write them, under torch.func inside use().

``edge_weight.new_zeros(n).scatter_add_(0, col, edge_weight)`` and ``torch.zeros(n, f).index_add_(0, col, msg)`` over
per-sample graphs: vmap refuses them natively; inside ``use()`` per-sample gradients through ``functional_call`` equal
a per-sample ``torch.autograd`` loop, with no fallback to vmap's per-sample loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

import registry
from bench.models.message_passing import (
    FEATURES,
    HIDDEN,
    GCNConv,
    GINConv,
    GraphClassifier,
    graphs,
    loop_gradients,
    per_sample_gradients,
)
from registry.core.functionalization import FUNCTIONALIZED

FALLBACK = "There is a performance drop"
REFUSAL = "is not possible because there exists a Tensor `other` in extra_args that has more elements than `self`"


@pytest.fixture
def fallback_warnings() -> Iterator[list[warnings.WarningMessage]]:
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)


def _data(batch: int = 5) -> tuple[GraphClassifier, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (GraphClassifier(), *graphs(batch, torch.Generator().manual_seed(3)))


def test_natively_vmap_refuses_the_scatter_into_a_fresh_buffer() -> None:
    with pytest.raises(RuntimeError, match=REFUSAL):
        per_sample_gradients(*_data())


def test_per_sample_gradients_inside_use_equal_the_loop(fallback_warnings: list[warnings.WarningMessage]) -> None:
    model, x, edge_index, y = _data()
    expected = loop_gradients(model, x, edge_index, y)
    FUNCTIONALIZED.clear()
    with registry.use():
        first = per_sample_gradients(model, x, edge_index, y)
        again = per_sample_gradients(model, x, edge_index, y)  # remembered: functionalized from the start
    assert sorted(first) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(first[name], expected[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(again[name], expected[name], rtol=1e-4, atol=1e-6)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []


def test_gcn_layer_jacobian_per_graph_equals_the_loop(fallback_warnings: list[warnings.WarningMessage]) -> None:
    """vmap(jacrev) of one GCN layer's output with respect to its node features, one graph per sample."""
    torch.manual_seed(0)
    layer = GCNConv(FEATURES, HIDDEN)
    x, edge_index, _ = graphs(3, torch.Generator().manual_seed(4))
    expected = torch.stack([torch.autograd.functional.jacobian(lambda v, e=e: layer(v, e), v)
                            for v, e in zip(x, edge_index, strict=True)])
    with registry.use():
        got = vmap(jacrev(layer))(x, edge_index)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert [str(w.message) for w in fallback_warnings if FALLBACK in str(w.message)] == []


def test_gin_layer_runs_natively_and_inside_use_alike() -> None:
    """Its buffer is made from the per-sample features (``x.new_zeros``): batched already, nothing to functionalize."""
    torch.manual_seed(0)
    layer = GINConv(FEATURES)
    x, edge_index, _ = graphs(4, torch.Generator().manual_seed(5))
    params = dict(layer.named_parameters())
    native = vmap(lambda v, e: functional_call(layer, params, (v, e)))(x, edge_index)
    with registry.use():
        routed = vmap(lambda v, e: functional_call(layer, params, (v, e)))(x, edge_index)
    expected = torch.stack([layer(v, e) for v, e in zip(x, edge_index, strict=True)])
    torch.testing.assert_close(native, expected)
    torch.testing.assert_close(routed, expected)


def test_ensemble_of_models_over_one_graph() -> None:
    """torch.func's model ensembling: stacked parameters of several models, vmapped over one shared graph."""
    torch.manual_seed(0)
    models = [GraphClassifier() for _ in range(3)]
    x, edge_index, _ = graphs(1, torch.Generator().manual_seed(6))
    stacked = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
               for name, _ in models[0].named_parameters()}
    with registry.use():
        got = vmap(lambda p: functional_call(models[0], p, (x[0], edge_index[0])))(stacked)
    with torch.no_grad():
        expected = torch.stack([m(x[0], edge_index[0]) for m in models])
    torch.testing.assert_close(got, expected)


def test_loss_is_the_cross_entropy_of_each_graph() -> None:
    """The loop reference differentiates what the transformed step differentiates."""
    model, x, edge_index, y = _data(2)
    logits = model(x[0], edge_index[0])
    loss = nn.functional.cross_entropy(logits.unsqueeze(0), y[0].unsqueeze(0))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    reference = loop_gradients(model, x, edge_index, y)
    for (name, _), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(reference[name][0], g)
