"""The router's state (registry.core.routing.Router): a bounded decision table with a generation, recording blocks,
and the selector's two steps (choose, explain)."""

from __future__ import annotations

import pytest
import torch
from torch import func

import registry
from registry.core import routing, selector
from registry.core.context import Context
from registry.core.routing import ROUTER

pytestmark = pytest.mark.usefixtures("routing_backend")


def _fill_under_vmap(sizes: range) -> None:
    index = torch.tensor([0])
    for size in sizes:  # each size bucket is another decision key
        func.vmap(lambda r: r.index_fill(0, index, 1.0))(torch.randn(2, 2**size))


def test_the_decision_tables_are_bounded(monkeypatch: pytest.MonkeyPatch, routing_backend: str) -> None:
    monkeypatch.setattr(routing, "DECISION_CAPACITY", 3)
    registry.clear_cache()
    cpp = ROUTER.cpp
    if cpp is not None:
        cpp.set_capacity(3)
    try:
        with registry.use():
            _fill_under_vmap(range(1, 9))
        assert 0 < len(ROUTER.decisions) <= 3
        if cpp is not None:
            assert 0 < cpp.size() <= 3
    finally:
        if cpp is not None:
            cpp.set_capacity(routing.DECISION_CAPACITY)
        registry.clear_cache()


def test_a_change_starts_a_generation_and_empties_both_tables() -> None:
    with registry.use():
        _fill_under_vmap(range(1, 3))
    generation = ROUTER.generation
    assert ROUTER.decisions or (ROUTER.cpp is not None and ROUTER.cpp.size())
    registry.clear_cache()
    assert ROUTER.generation == generation + 1
    assert not ROUTER.decisions and (ROUTER.cpp is None or ROUTER.cpp.size() == 0)


def test_a_recording_block_keeps_each_decision_and_its_calls() -> None:
    index = torch.tensor([0])
    with registry.use(record=True) as run:
        for _ in range(3):
            func.vmap(lambda r: r.index_fill(0, index, 1.0))(torch.randn(2, 4))
        with registry.use(pins={"index_fill": "functional"}):  # nested: records into the same run
            func.vmap(lambda r: r.index_fill(0, index, 1.0))(torch.randn(2, 4))
    expected = registry.select("index_fill", stack="vmap", batched=["self"], dtype="float32", numel=8,
                               tensors=["self", "index"])
    first, pinned = run.decisions
    assert (first.op, first.stack, first.composite, first.kind, first.calls) == (
        "index_fill", ("vmap",), expected.composite, expected.kind, 3)
    assert first.reason == expected.reason
    assert (pinned.composite, pinned.reason, pinned.calls) == ("functional", "pinned to functional by the caller.", 1)
    assert run.calls == {"index_fill.int_Scalar": 4}
    assert run.summary().splitlines()[1] == ("index_fill under vmap: functional (functional), 1 call; pinned to "
                                             "functional by the caller.")
    with registry.use():  # not recording: nothing is added
        func.vmap(lambda r: r.index_fill(0, index, 1.0))(torch.randn(2, 4))
    assert len(run.decisions) == 2 and run.calls == {"index_fill.int_Scalar": 4}


def test_outside_a_recording_block_use_has_no_run() -> None:
    with registry.use() as block, pytest.raises(RuntimeError, match="only a use\\(record=True\\) block records"):
        block.decisions  # noqa: B018


def test_choose_returns_the_structure_and_explain_writes_the_reason() -> None:
    ctx = Context(stack=("vmap",), batched=("self",), tensors=("self", "index"))
    choice = selector.choose("index_fill", ctx, "rules", None)
    assert choice.basis == selector.RULES and choice.chosen.kind == "functional"
    assert [c.name for c, _ in choice.skipped] == ["native"]
    assert selector.explain(choice) + "." == registry.select("index_fill", stack="vmap", batched=["self"],
                                                             tensors=["self", "index"], policy="rules").reason
