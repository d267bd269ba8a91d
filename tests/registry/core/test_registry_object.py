"""``Registry``: a second instance decides from its own op table, and the default one is unaffected."""

from __future__ import annotations

import pytest
import torch

import registry
from registry.core.registry_object import DEFAULT, Registry
from registry.core.selector import SelectionError


def _fill_with_where(self: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """index_fill as a where over a broadcast mask (the second registry's only composite)."""
    shape = [1] * self.dim()
    shape[dim] = self.shape[dim]
    mask = torch.zeros(self.shape[dim], dtype=torch.bool).index_fill(0, index, True).reshape(shape)
    return torch.where(mask, value, self)


def _second() -> Registry:
    second = Registry()
    second.define_op("index_fill", "int_Tensor", tensors=("self", "index", "value"), doc="index_fill, one composite",
                     generate=())
    second.register("index_fill", "functional", name="where")(_fill_with_where)
    return second


def test_a_second_registry_selects_from_its_own_table() -> None:
    default_before = registry.select("index_fill", stack="vmap", batched=["self"])
    second = _second()
    decision = second.select("index_fill", stack="vmap", batched=["self"])
    assert (decision.composite, decision.kind, decision.alternatives) == ("where", "functional", ())
    x, index, value = torch.randn(3, 4), torch.tensor([0, 2]), torch.tensor(5.0)
    torch.testing.assert_close(decision.fn(x, 1, index, value), x.index_fill(1, index, value))
    # The default registry keeps its own composites and decisions.
    assert "where" not in DEFAULT.composites["index_fill"] and list(second.composites["index_fill"]) == ["where"]
    assert registry.select("index_fill", stack="vmap", batched=["self"]) == default_before
    assert default_before.composite != "where"
    with pytest.raises(SelectionError, match="unknown op 'index_add'"):  # the second table covers index_fill alone
        second.select("index_add", stack="vmap")


def test_a_second_registry_keeps_its_own_cache_and_evidence() -> None:
    second = _second()
    second.table.load()  # the plugins' entry points: a change of the table, which a decision made across is not kept
    second.select("index_fill", stack="vmap", batched=["self"])
    assert len(second.selector.cache) == 1
    assert second.evidence is not DEFAULT.evidence and second.selector is not DEFAULT.selector
    default_generation = DEFAULT.selector.generation
    second.register("index_fill", "functional", name="where_again")(_fill_with_where)  # a change clears its cache
    assert len(second.selector.cache) == 0 and DEFAULT.selector.generation == default_generation
