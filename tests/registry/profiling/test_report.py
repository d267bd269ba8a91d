"""The speedup report: bars diverging from 1x with their spread, invalid composites marked as invalid, and the
contexts that were re-measured. The figure is checked as matplotlib objects before it is saved."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.container import BarContainer

from registry.reports.plots import (
    INVALID_COLOUR,
    INVALID_HATCH,
    INVALID_SPAN,
    REMEASURED_HATCH,
    SpeedupBar,
    remeasured,
    render_speedups_png,
    speedup_bars,
    speedup_figure,
    speedup_lines,
)
from registry.store.records import MatrixEntry, ProfileEntry


def _entry(composite: str, kind: str, median: float | None, iqr: float | None, *, detail: str = "",
           batch: int = 256, workload: str = "vmap") -> ProfileEntry:
    return ProfileEntry(op="masked_fill", composite=composite, kind=kind, stack=("vmap",), workload=workload,
                        dtype="float32", device="cpu", device_name="cpu", numel_bucket=1024, batch_size=batch,
                        valid=median is not None, detail=detail, median_us=median, iqr_us=iqr, runs=50,
                        peak_memory=None, source_hash="h", torch_version=torch.__version__)


def _cell(composite: str, pattern: str, status: str) -> MatrixEntry:
    return MatrixEntry(op="masked_fill", composite=composite, kind=composite, stack=("vmap",), pattern=pattern,
                       dtype="float32", status=status, detail="", max_abs_error=None, max_rel_error=None,
                       source_hash="h", torch_version=torch.__version__, device="cpu")


PROFILES = [
    _entry("native", "native", 400.0, 40.0),
    _entry("functional", "functional", 200.0, 20.0),
    _entry("primitive", "primitive", 100.0, 10.0,
           detail="re-measured 1x: primitive spread 40% (IQR/median) above 20%; first call 3.1 ms"),
    _entry("primitive", "primitive", 1.0, 0.0, batch=32),  # not the largest batch: not plotted
]


def test_bars_carry_the_spread_of_both_medians() -> None:
    bars = speedup_bars(PROFILES)
    assert [(b.composite, b.batch_size, b.remeasured, b.invalid) for b in bars] == [
        ("functional", 256, False, None), ("primitive", 256, True, None)]
    assert bars[0].speedup == 2.0
    assert (bars[0].low, bars[0].high) == (pytest.approx(380.0 / 210.0), pytest.approx(420.0 / 190.0))
    assert bars[1].speedup == 4.0
    assert (bars[1].low, bars[1].high) == (pytest.approx(380.0 / 105.0), pytest.approx(420.0 / 95.0))


def test_report_lists_what_was_re_measured_and_why() -> None:
    assert remeasured(PROFILES) == [
        "masked_fill vmap batch 256 float32: re-measured 1x: primitive spread 40% (IQR/median) above 20%"]
    assert remeasured([replace(p, detail="first call 1.0 ms") for p in PROFILES]) == []
    assert speedup_lines(PROFILES)[1] == ("  masked_fill     vmap        primitive      4.00x  [3.62 .. 4.42]  "
                                          "(re-measured)")


def test_invalid_composites_are_not_a_speed() -> None:
    profiles = [*PROFILES, _entry("mutating", "mutating", None, None, detail="RuntimeError: vmap: in-place")]
    # The matrix fails the primitive for the profile's batching (every argument), not only for pattern self.
    matrix = [_cell("primitive", "all", "mismatch"), _cell("functional", "self", "error"),
              _cell("native", "in_dims1", "slow")]
    bars = {b.composite: b for b in speedup_bars(profiles, matrix)}
    assert bars["primitive"] == SpeedupBar(
        op="masked_fill", workload="vmap", dtype="float32", device="cpu", batch_size=256, numel_bucket=1024,
        composite="primitive", kind="primitive", speedup=None, low=None, high=None, remeasured=True,
        invalid="mismatch in the verified matrix under vmap, pattern all",
        native_invalid="slow in the verified matrix under vmap, pattern in_dims1")
    assert (bars["mutating"].speedup, bars["mutating"].invalid) == (None, "profile invalid: RuntimeError: vmap: "
                                                                          "in-place")
    assert (bars["functional"].speedup, bars["functional"].invalid) == (2.0, None)  # pattern self is not its context
    assert speedup_lines(profiles, matrix) == [
        "  masked_fill     vmap        functional     2.00x  [1.81 .. 2.21]",
        "  masked_fill     vmap        mutating    invalid: profile invalid: RuntimeError: vmap: in-place",
        "  masked_fill     vmap        primitive   invalid: mismatch in the verified matrix under vmap, pattern all",
    ]
    # Without a valid native timing there is no speedup to show, and the text says so.
    no_native = [replace(PROFILES[0], valid=False, median_us=None, detail="RuntimeError: x"), PROFILES[1]]
    assert speedup_lines(no_native) == ["  masked_fill     vmap        functional  no valid native timing to compare "
                                        "with"]


def _figure_profiles() -> tuple[list[ProfileEntry], list[MatrixEntry]]:
    profiles = [_entry("native", "native", 400.0, 40.0), _entry("functional", "functional", 200.0, 20.0),
                _entry("mutating", "mutating", 800.0, 0.0), _entry("primitive", "primitive", 100.0, 10.0)]
    return profiles, [_cell("primitive", "all", "error"), _cell("native", "all", "slow")]


def test_figure_bars_diverge_from_1x_with_labels_error_bars_and_invalid_markers() -> None:
    profiles, matrix = _figure_profiles()
    figure = speedup_figure(speedup_bars(profiles, matrix))
    axes = figure.axes[0]
    assert axes.get_yscale() == "log"
    low, high = axes.get_ylim()
    assert low * high == pytest.approx(1.0)  # centred on 1x
    assert high > 2.21  # room for the tallest error bar
    width = 0.8 / 3  # three composites: functional, mutating, primitive (sorted)
    bars = {patch.get_gid(): patch for patch in axes.patches if patch.get_gid()}
    assert sorted(bars) == ["invalid:masked_fill/primitive/vmap", "speedup:masked_fill/functional/vmap",
                            "speedup:masked_fill/mutating/vmap"]
    faster, slower = bars["speedup:masked_fill/functional/vmap"], bars["speedup:masked_fill/mutating/vmap"]
    assert (faster.get_y(), faster.get_height()) == (1.0, pytest.approx(1.0))  # 1x up to 2x
    assert (slower.get_y(), slower.get_height()) == (1.0, pytest.approx(-0.5))  # 1x down to 0.5x
    assert faster.get_x() + faster.get_width() / 2 == pytest.approx(-width)
    assert faster.get_hatch() in (None, "") and slower.get_facecolor() != faster.get_facecolor()
    invalid = bars["invalid:masked_fill/primitive/vmap"]
    assert (invalid.get_y(), invalid.get_y() + invalid.get_height()) == (pytest.approx(1 / INVALID_SPAN),
                                                                         pytest.approx(INVALID_SPAN))
    assert invalid.get_hatch() == INVALID_HATCH and invalid.get_facecolor() == to_rgba(INVALID_COLOUR)
    assert invalid.get_x() + invalid.get_width() / 2 == pytest.approx(width)

    labels = [(t.get_text(), tuple(round(v, 4) for v in t.xy)) for t in axes.texts if hasattr(t, "xy")]
    assert labels == [("2x", (round(-width, 4), round(420.0 / 190.0, 4))),  # above its error bar
                      ("0.5x", (0.0, round(380.0 / 800.0, 4))),  # below its error bar
                      ("invalid", (round(width, 4), INVALID_SPAN))]
    assert {t.get_text() for t in axes.texts} >= {"faster than native", "slower than native"}

    segments = [container.errorbar.lines[2][0].get_segments()[0].tolist() for container in axes.containers
                if isinstance(container, BarContainer) and container.errorbar is not None]
    assert segments == [[[pytest.approx(-width), pytest.approx(380.0 / 210.0)],
                         [pytest.approx(-width), pytest.approx(420.0 / 190.0)]],
                        [[0.0, pytest.approx(380.0 / 800.0)], [0.0, pytest.approx(420.0 / 800.0)]]]
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["functional", "mutating",
                                                                    "invalid (not a speed)"]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["masked_fill\nvmap\n(native invalid)"]
    ticks = [t.get_text() for t in axes.get_yticklabels()]
    assert "1x" in ticks and "2x" in ticks and "0.5x" in ticks


def test_re_measured_bars_are_hatched_and_the_png_is_written(tmp_path) -> None:
    figure = speedup_figure(speedup_bars(PROFILES))
    hatches = {p.get_gid(): p.get_hatch() for p in figure.axes[0].patches if p.get_gid()}
    assert hatches == {"speedup:masked_fill/functional/vmap": "",
                       "speedup:masked_fill/primitive/vmap": REMEASURED_HATCH}
    profiles, matrix = _figure_profiles()
    out = render_speedups_png(profiles, tmp_path / "s.png", matrix=matrix)
    assert out == tmp_path / "s.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="^no timed or invalid composites to plot"):
        render_speedups_png([PROFILES[0]], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
