"""The speedup report: each bar with its spread, and the contexts that were re-measured."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from registry.reports.plots import remeasured, render_speedups_png, speedup_lines, speedup_rows
from registry.store.db import ProfileEntry


def _entry(composite: str, kind: str, median: float, iqr: float, *, detail: str = "", batch: int = 256,
           workload: str = "vmap") -> ProfileEntry:
    return ProfileEntry(op="masked_fill", composite=composite, kind=kind, stack=("vmap",), workload=workload,
                        dtype="float32", device="cpu", device_name="cpu", numel_bucket=1024, batch_size=batch,
                        valid=True, detail=detail, median_us=median, iqr_us=iqr, runs=50, peak_memory=None,
                        source_hash="h", torch_version=torch.__version__)


PROFILES = [
    _entry("native", "native", 400.0, 40.0),
    _entry("functional", "functional", 200.0, 20.0),
    _entry("primitive", "primitive", 100.0, 10.0,
           detail="re-measured 1x: primitive spread 40% (IQR/median) above 20%; first call 3.1 ms"),
    _entry("primitive", "primitive", 1.0, 0.0, batch=32),  # not the largest batch: not plotted
]


def test_rows_carry_the_spread_of_both_medians() -> None:
    rows = speedup_rows(PROFILES)
    assert [row[:3] for row in rows] == [("masked_fill", "vmap", "functional"), ("masked_fill", "vmap", "primitive")]
    _, _, _, ratio, low, high, again = rows[1]
    assert (ratio, again) == (4.0, True)
    assert low == pytest.approx(380.0 / 105.0) and high == pytest.approx(420.0 / 95.0)
    assert rows[0][-1] is False


def test_report_lists_what_was_re_measured_and_why() -> None:
    assert remeasured(PROFILES) == [
        "masked_fill vmap batch 256 float32: re-measured 1x: primitive spread 40% (IQR/median) above 20%"]
    assert remeasured([replace(p, detail="first call 1.0 ms") for p in PROFILES]) == []
    assert speedup_lines(PROFILES)[1] == ("  masked_fill     vmap        primitive      4.00x  [3.62 .. 4.42]  "
                                          "(re-measured)")


def test_png_is_written(tmp_path) -> None:
    out = render_speedups_png(PROFILES, tmp_path / "s.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no timed profiles to plot"):
        render_speedups_png([PROFILES[0]], tmp_path / "none.png")
