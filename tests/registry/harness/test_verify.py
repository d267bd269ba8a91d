"""verify(): the matrix finds wrong, vmap-hostile and falsely declared composites; auto avoids them; stale
entries are ignored; the built-in composites are ok wherever they claim support."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

import registry
from registry.core import rules
from registry.core.context import Context
from registry.core.registration import RegistrationError, register, unregister
from registry.core.sources import source_hash, source_hashes
from registry.harness.audit import audit
from registry.harness.samples import SAMPLES
from registry.harness.verify import default_stacks, verify
from registry.store import evidence
from registry.store.db import Store
from tests import cases


def test_stacks_are_generated() -> None:
    stacks = default_stacks()
    assert ("vmap",) in stacks and ("jvp", "grad", "vmap") in stacks and ("grad", "grad", "grad") in stacks
    assert ("compile", "vmap", "grad") in stacks and ("functionalize", "jvp") in stacks
    assert ("compile", "vmap", "grad", "jvp") not in stacks
    assert len(stacks) == 3 + 9 + 27 + 2 * (3 + 9)


@pytest.fixture
def bad_composites():
    """Three deliberately broken masked_fill composites, registered for the test only."""

    @register("masked_fill", "functional", name="test-secretly-mutating")
    def masked_fill_mutates(self, mask, value):
        """Declared functional, mutates a clone."""
        return self.clone().masked_fill_(mask, value)

    @register("masked_fill", "functional", name="test-wrong")
    def masked_fill_wrong(self, mask, value):
        """Off by a little."""
        return torch.where(mask, value, self) + 1e-3

    @register("masked_fill", "functional", name="test-vmap-hostile")
    def masked_fill_hostile(self, mask, value):
        """Data-dependent control flow."""
        return torch.where(mask, value, self) if bool(mask.any()) else self.clone()

    yield ("test-secretly-mutating", "test-wrong", "test-vmap-hostile")
    for name in ("test-secretly-mutating", "test-wrong", "test-vmap-hostile"):
        unregister("masked_fill", name)
    evidence.use_loader(None)


def test_audit_rejects_a_mutating_functional(bad_composites) -> None:
    with pytest.raises(RegistrationError) as error:
        audit("masked_fill", "test-secretly-mutating")
    assert "is declared functional but dispatches aten.masked_fill_.Scalar" in str(error.value)
    audit("masked_fill", "test-wrong")  # functional, just wrong: the audit does not judge values


def test_matrix_catches_each_and_auto_avoids_them(bad_composites) -> None:
    entries = verify(ops=["masked_fill"], stacks=["vmap", "grad"], dtypes=(torch.float32,), composites=bad_composites)
    status = {(e.composite, e.stack, e.pattern): e for e in entries}
    assert status["test-secretly-mutating", ("vmap",), "all"].status == "error"
    assert "audit:" in status["test-secretly-mutating", ("vmap",), "all"].detail
    wrong = status["test-wrong", ("vmap",), "all"]
    assert wrong.status == "mismatch" and wrong.max_abs_error == pytest.approx(1e-3, rel=1e-3)
    assert status["test-vmap-hostile", ("vmap",), "others"].status == "error"

    evidence.set_entries(entries)
    decision = registry.select("masked_fill", stack="vmap", batched=["mask"], dtype="float32")
    verdicts = {v.composite: v for v in decision.alternatives}
    assert decision.composite not in bad_composites
    for name in bad_composites:
        assert not verdicts[name].ok
        assert verdicts[name].reason.startswith(("error: measured: ", "mismatch: measured: "))
    with pytest.raises(registry.SelectionError, match="measured: test-wrong: mismatch 0.001 under vmap"):
        registry.select("masked_fill", stack="vmap", batched=["mask"], dtype="float32",
                        pins={"masked_fill": "test-wrong"})


def test_auto_cites_measured_evidence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from registry.core import reference, selector

    # The rules rank the valid composites here, not the shipped reference profiles (tests/registry/core/
    # test_reference.py covers those).
    monkeypatch.setattr(reference, "PATH", tmp_path / "no_reference_profiles.json")
    selector.clear_cache()
    entry = verify(ops=["index_fill"], stacks=["vmap"], dtypes=(torch.float32,), composites=["native"])
    evidence.set_entries(entry)
    try:
        decision = registry.select("index_fill", stack="vmap", batched=["value"], dtype="float32",
                                   tensors=("self", "index", "value"))
        native = next(v for v in decision.alternatives if v.composite == "native")
        assert not native.ok
        assert decision.kind == "functional"
        assert "(unverified: no measurement yet, rules decide)" in decision.reason
    finally:
        evidence.use_loader(None)


def test_entries_say_when_they_were_measured() -> None:
    before = time.time()
    seed = verify(ops=["index_fill"], stacks=["vmap"], dtypes=(torch.float32,), composites=["functional"])
    opinfo = verify(ops=["take"], stacks=["vmap"], dtypes=(torch.float32,), composites=["functional"])
    after = time.time()
    assert seed and opinfo
    assert all(before <= e.measured_at <= after for e in [*seed, *opinfo])


def test_stale_entries_are_ignored(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'm.db'}")
    entries = verify(ops=["masked_fill"], stacks=["vmap"], dtypes=(torch.float32,), composites=["functional"])
    store.write_entries(entries)
    hashes = source_hashes()
    fresh = store.fresh_entries(source_hashes=hashes, torch_version=torch.__version__)
    assert len(fresh) == len(entries) > 0
    changed = {**hashes, ("masked_fill", "functional"): "0" * 16}
    assert store.fresh_entries(source_hashes=changed, torch_version=torch.__version__) == []
    assert store.fresh_entries(source_hashes=hashes, torch_version="2.12.0") == []
    store.close()


def test_source_hash_follows_the_module_source() -> None:
    composite = registry.composites("masked_fill")["functional"]
    moved = dataclasses.replace(composite, name="other")
    assert source_hash(composite) != source_hash(moved)
    assert source_hash(composite) == source_hash(registry.composites("masked_fill")["functional"])


@pytest.fixture(scope="session")
def full_matrix():
    start = time.perf_counter()
    # The seed ops' matrix (compile around anything but vmap under make test-all only: tests/cases.py); ops with
    # OpInfo samples are checked cell by cell in tests/composites/test_coverage.py.
    entries = verify(ops=list(SAMPLES), stacks=cases.matrix_stacks(default_stacks()))
    return entries, time.perf_counter() - start


def test_full_default_matrix_is_fast_and_claims_hold(full_matrix) -> None:
    """The whole default matrix for the seven seed ops: every built-in non-native composite is ok wherever the
    rules claim it works. (How long it takes is measured by ``multicomposite verify`` and reported in
    docs/verification.md: a unit test asserts behaviour, not timings.)"""
    entries, _ = full_matrix
    broken = []
    for entry in entries:
        if entry.kind == "native" or entry.status in ("ok", "unsupported"):
            continue
        ctx = Context(stack=entry.stack, tensors=registry.OPS[entry.op].tensor_args)
        if rules.problem(entry.op, entry.kind, ctx) is None:
            broken.append(f"{entry.op}/{entry.composite} {entry.stack} {entry.pattern} {entry.dtype}: "
                          f"{entry.status} {entry.detail}")
    assert broken == []


def test_full_matrix_finds_native_failures(full_matrix) -> None:
    entries, _ = full_matrix
    failing = {(e.op, e.stack) for e in entries if e.kind == "native" and e.status in ("slow", "error", "mismatch")}
    assert ("masked_scatter", ("vmap",)) in failing
    assert ("index_fill", ("vmap", "jvp")) in failing
    assert ("to", ("vmap",)) in failing  # the channels_last sample
    functional = [e for e in entries if e.kind == "functional"]
    assert functional and all(e.status in ("ok", "unsupported") for e in functional)
