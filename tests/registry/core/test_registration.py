from __future__ import annotations

import gc
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import registry
from registry.core.registration import OpTable, RegistrationError, load_plugins, register, unregister
from registry.harness.samples import SAMPLES


def test_every_seed_op_has_all_four_kinds() -> None:
    for op in SAMPLES:  # the seed ops: hand-written samples, hand-written composites of every kind
        kinds = {c.kind for c in registry.composites(op).values()}
        # The fused primitives of the masked family and index_fill are also C++ ops (composites/cpp_ops.py), and
        # index_add is the rows op (composites/index.py).
        extra = {"cpp_op"} if op in ("masked_fill", "masked_scatter", "index_fill", "index_add") else set()
        assert kinds == {"native", "mutating", "functional", "primitive"} | extra, op


def test_composite_records_kind_doc_and_where() -> None:
    composite = registry.composites("index_fill")["functional"]
    assert composite.kind == "functional"
    assert composite.doc == "where(mask of index along dim, value, self)."
    path, line = composite.where.rsplit(":", 1)
    assert path.endswith("composites/index.py") and int(line) > 0
    assert "def index_fill_functional" in composite.source


def test_decorator_returns_function_unchanged() -> None:
    def index_fill_extra(self, dim, index, value):
        return self

    assert register("index_fill", "functional", name="test-extra")(index_fill_extra) is index_fill_extra
    unregister("index_fill", "test-extra")


def test_define_op_returns_its_opdef_which_registers() -> None:
    definition = registry.OPS["index_fill"]
    assert isinstance(definition, registry.core.model.OpDef) and definition.table is registry.DEFAULT.table
    assert set(definition.rules) <= set(registry.KINDS)
    assert definition.rules is registry.core.rules.OP_RULES["index_fill"]

    def index_fill_again(self, dim, index, value):
        return self

    assert definition.register("functional", name="test-opdef")(index_fill_again) is index_fill_again
    assert registry.composites("index_fill")["test-opdef"].fn is index_fill_again
    unregister("index_fill", "test-opdef")


def test_duplicate_registration_names_the_first() -> None:
    def index_fill_again(self, dim, index, value):
        return self

    first = registry.composites("index_fill")["functional"].where
    with pytest.raises(RegistrationError, match="already registered at " + first.replace("\\", "\\\\")):
        register("index_fill", "functional")(index_fill_again)


def test_signature_must_match_schema_and_error_shows_the_def() -> None:
    def index_fill_wrong(self, dim, idx, value):
        return self

    with pytest.raises(RegistrationError) as error:
        register("index_fill", "functional", name="wrong")(index_fill_wrong)
    message = str(error.value)
    assert "def index_fill_wrong(self, dim, idx, value)" in message
    assert "aten::index_fill.int_Tensor" in message
    assert "takes (self, dim, index, value)" in message
    assert "wrong" not in registry.composites("index_fill")


def test_keyword_only_parameters_are_checked() -> None:
    def index_add_positional_alpha(self, dim, index, source, alpha=1):
        return self

    with pytest.raises(RegistrationError, match=r"takes \(self, dim, index, source, \*, alpha\)"):
        register("index_add", "functional", name="positional-alpha")(index_add_positional_alpha)


def test_primitive_must_name_a_complete_autograd_function() -> None:
    def masked_fill_prim(self, mask, value):
        return self

    with pytest.raises(RegistrationError, match="without its torch.autograd.Function"):
        register("masked_fill", "primitive", name="p1")(masked_fill_prim)

    class NoRules(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad

    with pytest.raises(RegistrationError, match="lacks the staticmethods jvp, vmap"):
        register("masked_fill", "primitive", name="p2", function=NoRules)(masked_fill_prim)


def test_unknown_op_and_kind() -> None:
    with pytest.raises(RegistrationError, match="unknown op 'index_fil'"):
        register("index_fil", "functional")
    with pytest.raises(RegistrationError, match="unknown kind 'fused'"):
        register("index_fill", "fused")


def test_entry_point_plugin_adds_a_composite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mc_test_plugin.py").write_text(textwrap.dedent('''
        from registry import register

        @register("masked_fill", "functional", name="mc_test_plugin.where")
        def masked_fill_plugin(self, mask, value):
            """A plugin's masked_fill."""
            import torch
            return torch.where(mask, value, self)
    '''))
    dist = tmp_path / "mc_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mc-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[multicomposite.composites]\nwhere = mc_test_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "where" in load_plugins()
        composite = registry.composites("masked_fill")["mc_test_plugin.where"]
        assert composite.doc == "A plugin's masked_fill."
        x, mask = torch.randn(3), torch.tensor([True, False, True])
        with registry.use(pins={"masked_fill": "mc_test_plugin.where"}):
            torch.testing.assert_close(x.masked_fill(mask, 0.0), torch.where(mask, 0.0, x))
    finally:
        unregister("masked_fill", "mc_test_plugin.where")
        sys.modules.pop("mc_test_plugin", None)


def test_families_are_imported_with_the_collector_paused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family's import makes long-lived definitions and no garbage: no cyclic collection runs inside it (the full
    one ``import torch`` left owing would land there, registry/core/collector.py), and the collector is on after."""
    (tmp_path / "paused_family_probe.py").write_text("import gc\nCOLLECTOR_ON = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    enabled = gc.isenabled()
    gc.enable()
    try:
        OpTable(builtins=("paused_family_probe",)).load()
        assert gc.isenabled()
        assert sys.modules["paused_family_probe"].COLLECTOR_ON is False
    finally:
        if not enabled:
            gc.disable()
        sys.modules.pop("paused_family_probe", None)
