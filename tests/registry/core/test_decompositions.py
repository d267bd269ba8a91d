"""decomposition_table(): the selected composites as a table for make_fx, aot_autograd and export."""

from __future__ import annotations

import pytest
import torch
from torch._functorch.aot_autograd import aot_function  # noqa: PLC2701 - functorch's internals have no public API
from torch.fx.experimental.proxy_tensor import make_fx

import registry
from registry.core.selector import SelectionError

pytestmark = pytest.mark.usefixtures("routing_backend")

aten = torch.ops.aten


def f(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    filled = x.masked_fill(mask, source.sum())  # masked_fill.Tensor: native loops under vmap
    return filled.masked_scatter(~mask, source).index_fill(0, torch.tensor([1]), 2.0) * x


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=generator) > 0.5
    source = torch.randn(20, generator=generator, dtype=torch.float64)
    return x, mask, source


def _targets(graph: torch.fx.GraphModule) -> set[str]:
    return {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}


def test_table_holds_the_choices_under_the_stack() -> None:
    table = registry.decomposition_table(stack="vmap")
    assert aten.masked_scatter.default in table and aten.masked_scatter_.default in table
    assert aten.masked_fill.Tensor in table and aten.index_fill.int_Scalar in table
    assert aten.index_add.default not in table  # native has a batching rule there: PyTorch's kernel stays
    assert registry.decomposition_table(stack=()) == {}  # a flat graph: PyTorch's own kernels are the choice
    assert set(registry.decomposition_table(stack="vmap", ops=["masked_scatter"])) == {
        aten.masked_scatter.default, aten.masked_scatter_.default, aten.masked_scatter_backward.default}


def test_unknown_op_is_an_error() -> None:
    with pytest.raises(SelectionError, match="unknown op 'masked_scater'; did you mean masked_scatter"):
        registry.decomposition_table(ops=["masked_scater"])


def test_make_fx_with_the_table() -> None:
    x, mask, source = _inputs()
    graph = make_fx(f, decomposition_table=registry.decomposition_table(stack="vmap"))(x, mask, source)
    targets = _targets(graph)
    assert not {"aten.masked_scatter.default", "aten.masked_fill.Tensor", "aten.index_fill.int_Scalar"} & targets
    torch.testing.assert_close(graph(x, mask, source), f(x, mask, source))


def test_aot_autograd_with_the_table() -> None:
    x, mask, source = _inputs()
    graphs: list[torch.fx.GraphModule] = []

    def keep(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return graph

    compiled = aot_function(f, fw_compiler=keep, bw_compiler=keep,
                            decompositions=registry.decomposition_table(stack="vmap,grad"))
    leaf_x, leaf_source = x.clone().requires_grad_(), source.clone().requires_grad_()
    out = compiled(leaf_x, mask, leaf_source)
    out.sum().backward()
    ref_x, ref_source = x.clone().requires_grad_(), source.clone().requires_grad_()
    expected = f(ref_x, mask, ref_source)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(leaf_x.grad, ref_x.grad)
    torch.testing.assert_close(leaf_source.grad, ref_source.grad)
    assert len(graphs) == 2
    for graph in graphs:
        assert not _targets(graph) & {"aten.masked_scatter.default", "aten.masked_scatter_backward.default"}


def test_export_run_decompositions_with_the_table() -> None:
    class Module(torch.nn.Module):
        def forward(self, x, mask, source):
            return f(x, mask, source)

    x, mask, source = _inputs()
    exported = torch.export.export(Module(), (x, mask, source))
    assert "aten.masked_scatter.default" in _targets(exported.graph_module)
    decomposed = exported.run_decompositions(registry.decomposition_table(stack="vmap"))
    assert "aten.masked_scatter.default" not in _targets(decomposed.graph_module)
    torch.testing.assert_close(decomposed.module()(x, mask, source), f(x, mask, source))
