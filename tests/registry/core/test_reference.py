"""The shipped reference profiles: where nothing was measured here the selector ranks the valid composites by them;
an invalid composite is never chosen however fast; within the gap the rules' choice stays; a local profile
overrides them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import registry
from registry.core import reference, selector
from registry.core.sources import source_hashes
from registry.store import evidence
from registry.store.records import ProfileEntry


@pytest.fixture(autouse=True)
def _empty_evidence() -> Iterator[None]:
    evidence.set_entries(())
    evidence.set_profiles(())
    yield
    evidence.use_profile_loader(None)
    evidence.use_loader(None)
    reference._load.cache_clear()
    selector.clear_cache()


def _ship(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, times: dict[str, float], *,
          op: str = "masked_scatter") -> None:
    path = tmp_path / "reference_profiles.json"
    path.write_text(json.dumps({"machine": "a test machine", "contexts": [
        {"op": op, "stack": ["vmap", "grad"], "dtype": "float32", "workload": "vmap(grad)", "numel": 1000,
         "batch": 256, "times_us": times}]}))
    monkeypatch.setattr(reference, "PATH", path)
    selector.clear_cache()


def _select(op: str = "masked_scatter") -> registry.Decision:
    return registry.select(op, stack="vmap,grad", batched=["self", "mask", "source"] if op == "masked_scatter"
                           else ["self", "mask", "value"], dtype="float32", numel=1000)


def test_the_reference_ranks_the_valid_composites_where_nothing_was_measured(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _ship(monkeypatch, tmp_path, {"native": 900.0, "functional": 11500.0, "primitive": 5100.0})
    decision = _select()
    assert decision.composite == "primitive"
    assert decision.reason == (
        "primitive is the fastest valid composite under vmap(grad) with self, mask, source batched in the reference "
        "profiles shipped with the package (2.25x faster than functional; vmap(grad), batch 256 x 1000 elements, "
        "measured on a test machine); no profile of this machine here: `multicomposite profile` measures one "
        "(unverified: no measurement yet, the reference profiles decide).")


def test_the_reference_speaks_only_where_the_same_arguments_are_batched(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A workload that batched self and source says nothing of a call that batches another argument too (index_add
    with each sample's own index: functorch loops over the samples there), and speaks for one that batches fewer; a
    file that does not name its batched arguments speaks for every context of its stack."""
    path = tmp_path / "reference_profiles.json"
    context = {"op": "masked_scatter", "stack": ["vmap", "grad"], "dtype": "float32", "workload": "vmap(grad)",
               "numel": 1000, "batch": 256, "batched": ["self", "source"],
               "times_us": {"native": 900.0, "functional": 11500.0, "primitive": 5100.0}}
    path.write_text(json.dumps({"machine": "a test machine", "contexts": [context]}))
    monkeypatch.setattr(reference, "PATH", path)
    assert reference.reference_times("masked_scatter", ("vmap", "grad"), "float32", ("source", "self")) is not None
    assert reference.reference_times("masked_scatter", ("vmap", "grad"), "float32", ("self", "mask", "source")) is None
    assert reference.reference_times("masked_scatter", ("vmap", "grad"), "float32", ("source",)) is not None
    assert reference.reference_times("masked_scatter", ("vmap", "grad"), "float32", None) is not None  # unsaid
    selector.clear_cache()
    assert "reference profiles" not in _select().reason  # self, mask, source batched: the rules decide
    reference._load.cache_clear()
    del context["batched"]
    path.write_text(json.dumps({"machine": "a test machine", "contexts": [context]}))
    selector.clear_cache()
    assert _select().composite == "primitive"


def test_the_shipped_index_add_reference_is_of_a_shared_index() -> None:
    """The shipped index_add profile (a shared index) keeps its ranking where the index is shared and leaves a
    per-sample index to the rules (the rows op, composites/index.py)."""
    shared = reference.reference_times("index_add", ("vmap", "grad"), "float32", ("self", "source"))
    assert shared is not None and shared.batched == frozenset({"self", "source"})
    assert reference.reference_times("index_add", ("vmap", "grad"), "float32", ("self", "index", "source")) is None


def test_an_invalid_composite_is_never_chosen_however_fast_its_reference(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # native loops under vmap(grad) (the rules say slow): its reference time does not make it a choice.
    _ship(monkeypatch, tmp_path, {"native": 10.0, "functional": 11500.0, "primitive": 5100.0})
    assert _select().composite == "primitive"


def test_within_the_gap_the_rules_choice_stays(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _ship(monkeypatch, tmp_path, {"functional": 1050.0, "primitive": 1000.0})
    decision = _select()
    assert decision.composite == "functional"
    assert "no profile here to rank the primitive" in decision.reason


def test_policy_rules_ignores_the_reference(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _ship(monkeypatch, tmp_path, {"functional": 11500.0, "primitive": 5100.0})
    decision = registry.select("masked_scatter", stack="vmap,grad", batched=["self", "mask", "source"],
                               dtype="float32", numel=1000, policy="rules")
    assert decision.composite == "functional"


def test_a_local_profile_overrides_the_reference(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _ship(monkeypatch, tmp_path, {"functional": 11500.0, "primitive": 5100.0})

    def entry(composite: str, median: float) -> ProfileEntry:
        return ProfileEntry(op="masked_scatter", composite=composite, kind=composite, stack=("vmap", "grad"),
                            workload="vmap(grad)", dtype="float32", device="cpu", device_name="cpu",
                            numel_bucket=1024, batch_size=256, valid=True, detail="", median_us=median, iqr_us=1.0,
                            runs=10, peak_memory=None, source_hash=source_hashes()["masked_scatter", composite],
                            torch_version=torch.__version__)

    evidence.set_profiles([entry("functional", 1000.0), entry("primitive", 3000.0)])
    decision = _select()
    assert decision.composite == "functional"
    assert "is the fastest valid composite measured under" in decision.reason


def test_an_unreadable_reference_file_says_how_to_regenerate_it(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    path = tmp_path / "reference_profiles.json"
    path.write_text("{\"machine\": 1}")
    with pytest.raises(reference.ReferenceError, match="unreadable reference profiles .*python -m bench.reference "
                                                       "measure"):
        reference._load(path)


def test_the_shipped_file_covers_the_three_slow_defaults() -> None:
    reference._load.cache_clear()
    assert reference.machine()
    for op in ("masked_scatter", "masked_fill", "index_fill"):
        found = reference.reference_times(op, ("vmap", "grad"), "float32")
        assert found is not None, op
        assert {"functional", "primitive"} <= set(found.times_us), op
        assert (found.batch, found.numel) == (256, 1000)
