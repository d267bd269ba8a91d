from __future__ import annotations

import pytest
import torch

import registry
from registry.core import kernels, selector
from registry.core.selector import SelectionError


def test_decision_shape_and_reason() -> None:
    decision = registry.select("masked_scatter", stack="vmap,grad", batched=["self"], policy="rules")
    assert decision.op == "masked_scatter"
    assert (decision.composite, decision.kind) == ("functional", "functional")
    assert decision.reason.startswith("native fails under vmap(grad) with self batched (slow: aten::masked_scatter "
                                      "has no batching rule, so vmap runs a per-sample loop); functional is the next")
    by_name = {v.composite: v for v in decision.alternatives}
    # cpp_op is judged where the C++ ops are built (its rule refuses it elsewhere: tests/composites/test_cpp_ops.py)
    cpp_op = {"cpp_op"} if kernels.fused_ops_available() else set()
    assert set(by_name) == {"native", "mutating", "primitive"} | cpp_op
    assert by_name["primitive"].ok and not by_name["native"].ok and not by_name["mutating"].ok
    assert by_name["primitive"].reason == "valid; ranked below the choice"
    assert by_name["native"].reason.startswith("slow:")


def test_native_chosen_where_it_is_good() -> None:
    for stack in ("", "vmap", "vmap,grad", "grad", "functionalize"):
        assert registry.select("index_add", stack=stack).kind == "native"
    assert registry.select("masked_fill", stack="vmap", tensors=("self", "mask")).kind == "native"
    # Tensor value: no batching rule (the rules' kind; auto ranks the valid ones by the reference profiles)
    assert registry.select("masked_fill", stack="vmap", policy="rules").kind == "functional"
    assert registry.select("masked_fill", stack="vmap").kind != "native"


def test_kind_preference_by_context() -> None:
    # The rules' kinds (auto reorders the valid non-native ones by the shipped reference profiles).
    def kind(op: str, **query: object) -> str:
        return registry.select(op, policy="rules", **query).kind

    assert kind("index_fill", stack="vmap") == "functional"
    assert kind("index_fill", stack="vmap,jvp") == "functional"
    assert kind("index_fill", stack="grad") == "functional"  # negative indices break native's
    assert kind("index_fill", stack="autograd", tensors=("self", "index")) == "native"
    assert kind("index_fill", stack="autograd") == "functional"
    assert kind("masked_scatter", stack="grad") == "functional"  # jacrev vmaps the backward
    # With its default memory format native batches, under a vmap inside a compiled function too (test_memory.py has
    # the memory_format case).
    assert kind("to", stack="compile") == "native"


def test_primitive_never_under_functionalize() -> None:
    decision = registry.select("masked_scatter", stack="functionalize,vmap")
    assert decision.kind == "functional"
    with pytest.raises(SelectionError, match="pinned composite primitive .* not valid under functionalize:"):
        registry.select("index_fill", stack="functionalize", pins={"index_fill": "primitive"})


def test_policy_native_routes_nothing() -> None:
    decision = registry.select("masked_scatter", stack="vmap", policy="native")
    assert decision.kind == "native"
    assert decision.reason == "policy native routes nothing: PyTorch's own op runs."


def test_pins_by_kind_and_by_name() -> None:
    assert registry.select("index_add", stack="", pins={"index_add": "functional"}).composite == "functional"
    assert registry.select("index_add", stack="", pins={"index_add": "primitive"}).reason == \
        "pinned to primitive by the caller."


def test_invalid_pin_names_op_stack_and_valid_choices() -> None:
    with pytest.raises(SelectionError) as error:
        registry.select("index_fill", stack="vmap,jvp", batched=["value"], pins={"index_fill": "mutating"})
    assert str(error.value).startswith(
        "select(index_fill): pinned composite mutating (mutating) is not valid under vmap(jvp) with value batched: "
    )
    cpp_op = ", cpp_op" if kernels.fused_ops_available() else ""  # valid where the C++ ops are built
    assert str(error.value).endswith(f"valid choices: functional, primitive{cpp_op}")


def test_a_pin_of_native_where_it_only_loops_runs_it() -> None:
    # Under vmap PyTorch's SDPA on 4-d samples loops over its fused kernel: slow, but correct, so a pin runs it.
    decision = registry.select("scaled_dot_product_attention", stack="vmap", batched=["query"],
                               pins={"scaled_dot_product_attention": "native"})
    assert (decision.composite, decision.kind, decision.reason) == ("native", "native",
                                                                    "pinned to native by the caller.")


def test_unknown_pin_op_policy_dtype_and_batched_name() -> None:
    with pytest.raises(SelectionError, match="names no composite or kind of index_fill; registered: native"):
        registry.select("index_fill", stack="vmap", pins={"index_fill": "fastest"})
    with pytest.raises(SelectionError, match="unknown op 'masked_fil'; did you mean masked_fill"):
        registry.select("masked_fil", stack="vmap")
    with pytest.raises(SelectionError, match="unknown policy 'best'; policies are auto, fastest, rules, native"):
        registry.select("index_fill", stack="vmap", policy="best")
    with pytest.raises(SelectionError, match="unknown dtype 'float33'"):
        registry.select("index_fill", stack="vmap", dtype="float33")
    with pytest.raises(SelectionError, match="batched names src are not tensor arguments of index_add"):
        registry.select("index_add", stack="vmap", batched=["src"])
    with pytest.raises(SelectionError, match="needs vmap in the stack"):
        registry.select("index_add", stack="grad", batched=["self"])


def test_no_valid_composite_lists_every_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.core import rules
    from registry.core.rules import Problem

    refused = {kind: lambda ctx: Problem("error", "test") for kind in ("functional", "cpp_op")}
    monkeypatch.setattr(rules, "KIND_RULES", {**rules.KIND_RULES, **refused})
    selector.clear_cache()
    try:
        with pytest.raises(SelectionError) as error:
            registry.select("index_fill", stack="functionalize,vmap,jvp", batched=["value"])
        assert str(error.value).startswith(
            "select(index_fill): no composite is valid under functionalize(vmap(jvp)) with value batched; "
            "registered: native [mismatch], mutating [error], functional [error], primitive [error], cpp_op [error]."
        )
    finally:
        selector.clear_cache()


def test_decisions_are_cached_per_context() -> None:
    first = registry.select("index_fill", stack="vmap,grad", dtype="float32")
    assert registry.select("index_fill", stack="vmap,grad", dtype=torch.float32) is first
    assert registry.select("index_fill", stack="vmap,grad", dtype="float64") is not first


def test_no_valid_composite_where_native_only_loops_runs_native(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under vmap(functionalize) linalg_ldl_solve's primitive cannot run and native loops: PyTorch's own op runs, as
    # without use(), instead of an error (a function functionalized automatically reaches it).
    decision = registry.select("linalg_ldl_solve", stack="vmap,functionalize", batched=["LD"])
    assert (decision.composite, decision.kind) == ("native", "native")
    assert decision.reason.startswith("no composite is valid under vmap(functionalize) with LD batched (native [slow], "
                                      "primitive [error]); PyTorch's own linalg_ldl_solve runs, in vmap's per-sample "
                                      "loop, as it does without use().")
