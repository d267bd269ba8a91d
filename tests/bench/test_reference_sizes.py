"""bench/reference.py's ``sizes``: one op's grid measured into a file, the other ops' grids kept with their machine,
and the selector reading what was written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import reference, size_grids
from registry.core import cost


def test_one_ops_grid_is_measured_and_the_others_are_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tiny = size_grids.SizeGrid(op="pdist", axes={"batch": (2,), "rows": (4,), "features": (2,)}, variants=({},),
                               inputs=size_grids.PDIST.inputs, too_large=lambda at: False)
    monkeypatch.setitem(size_grids.GRIDS, "pdist", tiny)
    path = tmp_path / "reference_costs.json"
    other = {"op": "ctc_loss", "stack": ["vmap"], "workload": "vmap", "fixed": {}, "axes": {"batch": [1]},
             "points": [{"at": {"batch": 1}, "times_us": {"native": 1.0, "functional": 2.0}}]}
    path.write_text(json.dumps({"machine": "an older machine", "grids": [other]}))

    document = reference.measure_sizes(path, min_run_time=0.01, rounds=1, ops=["pdist"])

    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(document))
    assert [(g["op"], g["workload"]) for g in written["grids"]] == [
        ("ctc_loss", "vmap"), ("pdist", "vmap"), ("pdist", "vmap(grad)")]
    assert written["grids"][0] == {**other, "machine": "an older machine"}
    for grid in written["grids"][1:]:
        assert grid["machine"] == reference.machine_name()
        assert [point["at"] for point in grid["points"]] == [{"batch": 2, "rows": 4, "features": 2}]
        assert set(grid["points"][0]["times_us"]) == {"native", "functional"}
    costs = cost._load(path)
    assert costs.grid("ctc_loss", ("vmap",), {}).machine == "an older machine"
    assert costs.grid("pdist", ("vmap", "grad"), {}).machine == reference.machine_name()


def test_an_op_without_a_grid_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no size grid for masked_fill; the grids are scaled_dot_product_attention, "
                                         "ctc_loss, pdist"):
        reference.measure_sizes(tmp_path / "costs.json", min_run_time=0.01, rounds=1, ops=["masked_fill"])


def test_the_generic_grids_are_the_ops_with_the_generic_signature() -> None:
    from registry.core.routing import ROUTER

    signatures = ROUTER.table.signatures
    generic = {op for op in signatures.by_op if signatures.measured_only(op)}
    assert set(size_grids.OPINFO_GRID_OPS) <= generic
    assert generic - set(size_grids.OPINFO_GRID_OPS) == {f"_upsample_nearest_exact{k}d" for k in (1, 2, 3)}
    assert all(op in size_grids.GRIDS for op in generic - set(size_grids.OPINFO_GRID_OPS))  # a grid of their own


@pytest.mark.parametrize("op", size_grids.OPINFO_GRID_OPS)
def test_a_generic_grid_runs_its_samples_under_its_workloads(op: str) -> None:
    """Each numel of the grid is its sample's input (bucketed), the input batched: native and every composite valid
    there run it under each workload, and agree."""
    import registry
    from registry.core.registration import COMPOSITES

    grid = size_grids.opinfo_grid(op)
    assert grid.variants == ({"batched": registry.OPS[op].tensor_args[0]},)
    for numel in grid.axes["numel"]:
        forward, inputs, differentiable = grid.inputs({"batch": 3, "numel": numel}, grid.variants[0], None)
        assert size_grids.bucket(inputs[0][0].numel()) == numel
        for workload in grid.workloads:
            run = size_grids.runnable(forward, differentiable, workload, grid.shared, len(inputs))
            results = []
            for composite in COMPOSITES[op]:
                try:
                    with registry.use(pins={op: composite}):
                        results.append(run(*inputs))
                except registry.SelectionError:  # not valid here (a custom_op under grad): not timed either
                    continue
            for result in results[1:]:
                torch.testing.assert_close(result, results[0], equal_nan=True)
