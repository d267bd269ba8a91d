"""Selection by cost at the call's sizes (registry/core/cost.py): where native is correct and only loops, native or a
composite by their cost at the call's size bucket, read from a reference table (here a synthetic one), the ratio named
in the reason; native with nothing known; the bucket part of the routing key on both backends."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import func

import registry
from registry.core import cost, selector
from registry.core.context import Context
from registry.core.sources import source_hashes
from registry.store import evidence
from registry.store.records import ProfileEntry

pytestmark = pytest.mark.usefixtures("routing_backend")

OP = "scaled_dot_product_attention"
SDPA = torch.nn.functional.scaled_dot_product_attention
# primitive / native: 1.30x slower at batch 1, a tie at 16, 2.00x faster at 256.
TIMES = {1: {"native": 100.0, "primitive": 130.0, "functional": 400.0},
         16: {"native": 1000.0, "primitive": 1000.0, "functional": 3000.0},
         256: {"native": 20000.0, "primitive": 10000.0, "functional": 40000.0}}


@pytest.fixture(autouse=True)
def _synthetic_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    evidence.set_entries(())
    evidence.set_profiles(())
    path = tmp_path / "reference_costs.json"
    path.write_text(json.dumps({"machine": "a test machine", "grids": [
        {"op": OP, "stack": ["vmap"], "fixed": {"mask": False, "rank": 4},
         "axes": {"batch": [1, 16, 256], "length": [16], "heads": [2], "head_dim": [16]},
         "points": [{"at": {"batch": b, "length": 16, "heads": 2, "head_dim": 16}, "times_us": t}
                    for b, t in TIMES.items()]}]}))
    monkeypatch.setattr(cost, "PATH", path)
    cost._load.cache_clear()
    selector.clear_cache()
    yield path
    evidence.use_profile_loader(None)
    evidence.use_loader(None)
    cost._load.cache_clear()
    selector.clear_cache()


def _context(batch: int, *, length: int = 16, stack: tuple[str, ...] = ("vmap",)) -> Context:
    shape = (1, 2, length, 16)
    return Context(stack=stack, batched=("query", "key", "value"), dtype=torch.float32, device="cpu",
                   tensors=("query", "key", "value"), shapes=(shape, shape, shape), batch_size=batch)


def test_native_where_the_composite_costs_more_at_the_bucket() -> None:
    decision = selector.decide(OP, _context(1))
    assert decision.composite == "native"
    assert decision.reason == (
        "PyTorch's own scaled_dot_product_attention runs under vmap at batch 1, heads 2, length 16, head_dim 16, "
        "no mask, rank 4: correct here (vmap's per-sample loop), and primitive is 1.30x slower than native at this "
        "size (the reference costs shipped with the package, interpolated between measured sizes; thread CPU time, "
        "one thread, measured on a test machine).")


def test_the_composite_where_it_is_faster_at_the_bucket() -> None:
    decision = selector.decide(OP, _context(256))
    assert decision.composite == "primitive"
    assert decision.speedup == pytest.approx(2.0)
    assert "primitive is 2.00x faster than native under vmap at batch 256, heads 2" in decision.reason


def test_a_tie_keeps_native() -> None:
    decision = selector.decide(OP, _context(16))
    assert decision.composite == "native"
    assert "primitive is 1.00x faster than native at this size" in decision.reason


def test_between_grid_points_the_log_ratio_is_interpolated_in_log2_sizes() -> None:
    # batch 100 (bucket 64): half way from 16 to 256 in log2, so the ratio is 1.0 ** 0.5 * 0.5 ** 0.5 = 0.707.
    decision = selector.decide(OP, _context(100))
    assert decision.composite == "primitive"
    assert decision.speedup == pytest.approx(2 ** 0.5, rel=1e-6)
    assert "1.41x faster than native under vmap at batch 64" in decision.reason


def test_outside_the_grid_the_nearest_edge_holds() -> None:
    assert selector.decide(OP, _context(4096)).speedup == pytest.approx(2.0)
    assert selector.decide(OP, _context(4, length=1024)).composite == "native"  # length clamped to 16


def test_nothing_known_native_runs() -> None:
    decision = selector.decide(OP, _context(256, stack=("vmap", "grad")))  # no grid for vmap(grad) here
    assert decision.composite == "native"
    assert decision.reason == (
        "PyTorch's own scaled_dot_product_attention runs under vmap,grad at batch 256, heads 2, length 16, "
        "head_dim 16, no mask, rank 4: it is correct here (vmap's per-sample loop), and no cost of a composite is "
        "known at this size.")


def test_where_native_fails_cost_does_not_decide() -> None:
    decision = selector.decide(OP, _context(1, stack=("vmap", "jvp")))  # native raises under jvp
    assert decision.composite != "native"


def test_policy_rules_ignores_costs() -> None:
    assert selector.decide(OP, _context(1), policy="rules").composite == "primitive"


def _fallbacks(caught: list[warnings.WarningMessage]) -> set[str]:
    return {str(w.message).split("batching rule for ")[1].split(".")[0] for w in caught
            if "There is a performance drop" in str(w.message)}


def test_the_routing_key_holds_the_bucket(fallback_warnings: list, routing_backend: str) -> None:
    """One process, one use(): batch 2 runs native (vmap's loop over the fused kernel, whose fallback warnings show
    it, on the Python backend; the C++ backend's batching rule folds it), batch 256 the folded primitive (no loop);
    the decision cached for one does not answer the other."""
    run = func.vmap(lambda q, k, v: SDPA(q, k, v))
    seen, chosen = {}, {}
    for batch in (2, 256, 2):
        q = torch.randn(batch, 1, 2, 16, 16)
        fallback_warnings.clear()
        with registry.use(record=True) as block:
            out = run(q, q, q)
        seen.setdefault(batch, []).append(_fallbacks(fallback_warnings))
        chosen.setdefault(batch, []).append({d.composite for d in block.decisions if d.op == OP})
        torch.testing.assert_close(out, func.vmap(lambda x: SDPA(x, x, x))(q))
    assert chosen == {2: [{"native"}] * 2, 256: [{"primitive"}]}
    loop = set() if routing_backend == "cpp" else {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    assert seen[2] == [loop] * 2
    assert seen[256] == [set()]


# --- native with the C++ batching rules: the baseline where they would serve the call ------------------------------

# At batch 256 the folded primitive beats native's loop (2.00x) but not native with the C++ rule (1.25x slower).
WITH_RULES = {**TIMES[256], "native_batch_rules": 8000.0}


@pytest.fixture
def _table_with_rules(_synthetic_table: Path) -> Path:
    document = json.loads(_synthetic_table.read_text())
    for point in document["grids"][0]["points"]:
        if point["at"]["batch"] == 256:
            point["times_us"] = WITH_RULES
    _synthetic_table.write_text(json.dumps(document))
    cost._load.cache_clear()
    selector.clear_cache()
    return _synthetic_table


@pytest.mark.usefixtures("_table_with_rules")
def test_where_the_rules_would_serve_native_is_weighed_with_them() -> None:
    decision = selector.decide(OP, dataclasses.replace(_context(256), native_batch_rules=True))
    assert decision.composite == "native"
    assert decision.speedup == 1.0
    assert decision.reason == (
        "PyTorch's own scaled_dot_product_attention runs under vmap at batch 256, heads 2, length 16, head_dim 16, "
        "no mask, rank 4: correct here (its batch folded by this package's C++ batching rule), and primitive is "
        "1.25x slower than native with that rule at this size (the reference costs shipped with the package, "
        "interpolated between measured sizes; thread CPU time, one thread, measured on a test machine).")


@pytest.mark.usefixtures("_table_with_rules")
def test_without_the_rules_native_is_weighed_by_its_loop() -> None:
    decision = selector.decide(OP, _context(256))
    assert (decision.composite, decision.speedup) == ("primitive", pytest.approx(2.0))


@pytest.mark.usefixtures("_table_with_rules")
def test_a_point_that_did_not_time_the_rules_weighs_the_loop() -> None:
    # batch 100 lies between 16 (no rules timed: the loop) and 256 (the rules): 1.0 ** 0.5 * 1.25 ** 0.5 = 1.118.
    decision = selector.decide(OP, dataclasses.replace(_context(100), native_batch_rules=True))
    assert decision.composite == "native"
    assert "primitive is 1.12x slower than native with that rule" in decision.reason


@pytest.mark.usefixtures("_table_with_rules")
def test_use_weighs_native_with_the_rules_on_the_cpp_backend(fallback_warnings: list, routing_backend: str) -> None:
    """Inside use() at batch 256: on the C++ backend native (its rule folds the batch: no loop), on the Python one the
    folded primitive; with the rules turned off the C++ backend decides as the Python one."""
    run = func.vmap(lambda q, k, v: SDPA(q, k, v))
    q = torch.randn(256, 1, 2, 16, 16)
    expected = func.vmap(lambda x: SDPA(x, x, x))(q)

    def chosen() -> set[str]:
        fallback_warnings.clear()
        with registry.use(record=True) as block:
            out = run(q, q, q)
        assert _fallbacks(fallback_warnings) == set()
        torch.testing.assert_close(out, expected)
        return {d.composite for d in block.decisions if d.op == OP}

    if routing_backend == "python":
        assert chosen() == {"primitive"}
        return
    assert chosen() == {"native"}
    router = registry.DEFAULT.router
    router.set_batch_rules_enabled(False)
    try:
        assert chosen() == {"primitive"}
    finally:
        router.set_batch_rules_enabled(True)
    assert chosen() == {"native"}


def _profiled(composite: str, median_us: float) -> ProfileEntry:
    return ProfileEntry(op=OP, composite=composite, kind=composite, stack=("vmap",), workload="vmap",
                        dtype="float32", device="cpu", device_name="cpu", numel_bucket=512, batch_size=256,
                        valid=True, detail="", median_us=median_us, iqr_us=median_us / 100, runs=100,
                        peak_memory=None, source_hash=source_hashes()[OP, composite], torch_version=torch.__version__)


@pytest.mark.usefixtures("_table_with_rules")
def test_a_local_profile_decides_where_the_rules_do_not_serve() -> None:
    # The local profile timed native outside use(): vmap's loop, 4x the folded primitive.
    evidence.set_profiles([_profiled("native", 400.0), _profiled("primitive", 100.0)])
    plain = dataclasses.replace(_context(256), numel=512)
    decision = selector.decide(OP, plain)
    assert (decision.composite, decision.speedup) == ("primitive", pytest.approx(4.0))
    assert decision.reason.endswith("(profiled on this machine at 512 elements, batch 256).")
    # Where the C++ rule would serve native, that loop is not what runs: the reference costs, which time the rule.
    decision = selector.decide(OP, dataclasses.replace(plain, native_batch_rules=True))
    assert decision.composite == "native"
    assert "1.25x slower than native with that rule" in decision.reason


# --- select(): the call's sizes described, as use() sees them -------------------------------------------------------

SAMPLE = {"query": (1, 2, 16, 16), "key": (1, 2, 16, 16), "value": (1, 2, 16, 16)}


def test_select_decides_by_cost_at_the_described_sizes() -> None:
    """select() with per-sample shapes and a batch size reaches the same choice by cost as a call of those sizes."""
    small = registry.select(OP, stack="vmap", batched=list(SAMPLE), shapes=SAMPLE, batch_size=2)
    large = registry.select(OP, stack="vmap", batched=list(SAMPLE), shapes=SAMPLE, batch_size=256)
    assert (small.composite, large.composite) == ("native", "primitive")
    assert "at batch 256, heads 2, length 16, head_dim 16, no mask, rank 4" in large.reason
    assert large.speedup == pytest.approx(2.0)
    assert registry.select(OP, stack="vmap", batched=list(SAMPLE)).composite == "primitive"  # no sizes: the rules


@pytest.mark.usefixtures("_table_with_rules")
def test_select_weighs_the_rules_where_told_they_serve() -> None:
    told = registry.select(OP, stack="vmap", batched=list(SAMPLE), shapes=SAMPLE, batch_size=256,
                           native_batch_rules=True)
    assert told.composite == "native"
    assert "slower than native with that rule" in told.reason


@pytest.mark.parametrize(("shapes", "batch_size", "message"), [
    ({"query": (1, 2, 16, 16)}, 1, "shapes has no per-sample shape for key, value"),
    ({**SAMPLE, "mask": (1,)}, 1, "shapes names mask, which are not tensor arguments given here"),
    ({**SAMPLE, "query": (1, -2, 16, 16)}, 1, r"the shape of query must be natural numbers, not \[1, -2, 16, 16\]"),
    (SAMPLE, -1, "batch_size must be a natural number of samples, not -1"),
])
def test_select_refuses_sizes_it_cannot_read(shapes: dict, batch_size: int, message: str) -> None:
    with pytest.raises(selector.SelectionError, match=message):
        registry.select(OP, stack="vmap", batched=["query"], shapes=shapes, batch_size=batch_size,
                        tensors=list(SAMPLE))


# --- the generic signature: costs measured on OpInfo's samples decide only within what they measured -----------------

HISTC_TIMES = {1: {"native": 100.0, "primitive": 200.0}, 256: {"native": 8000.0, "primitive": 400.0}}


def _histc_context(batch: int, numel: int, *, batched: tuple[str, ...] = ("self",),
                   stack: tuple[str, ...] = ("vmap",)) -> Context:
    return Context(stack=stack, batched=batched, dtype=torch.float32, device="cpu", numel=numel, tensors=("self",),
                   shapes=((numel,),), batch_size=batch)


def test_generic_costs_decide_only_within_the_measured_sizes(_synthetic_table: Path) -> None:
    _synthetic_table.write_text(json.dumps({"machine": "a test machine", "grids": [
        {"op": "histc", "stack": ["vmap"], "fixed": {"batched": "self"}, "axes": {"batch": [1, 256], "numel": [64]},
         "points": [{"at": {"batch": b, "numel": 64}, "times_us": t} for b, t in HISTC_TIMES.items()]}]}))
    cost._load.cache_clear()
    selector.clear_cache()
    rules_choice = selector.decide("histc", _histc_context(1, 64), policy="rules").composite
    assert rules_choice == "primitive"
    one = selector.decide("histc", _histc_context(1, 64))
    assert (one.composite, one.native_loops) == ("native", True)
    assert "primitive is 2.00x slower than native at this size" in one.reason
    assert selector.decide("histc", _histc_context(256, 40)).composite == "primitive"  # 32 elements: measured up to 64
    described = registry.select("histc", stack="vmap", batched=["self"], shapes={"self": (8, 8)}, batch_size=1)
    assert (described.composite, described.reason) == ("native", one.reason)
    # Larger samples than measured, another batching, a stack with no grid: the rules, as without a signature.
    for unmeasured in (_histc_context(1, 1000), _histc_context(1, 64, batched=("self", "weight")),
                       _histc_context(1, 64, stack=("vmap", "vmap"))):
        decision = selector.decide("histc", unmeasured)
        assert decision.composite == rules_choice
        assert "at this size" not in decision.reason
