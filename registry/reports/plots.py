"""A heatmap of the compatibility matrix: op/composite rows, transform-stack columns, worst status per cell."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.core.status import FAILING, worst
from registry.store.records import MatrixEntry

# Worst last: a cell shows the worst status over its patterns and dtypes. Unlike an aggregate over samples, a cell
# ranks "unsupported" above "ok": a pattern that could not be checked shows, rather than hiding behind one that was.
SEVERITY: tuple[str, ...] = ("ok", "unsupported", *FAILING)
COLOURS: dict[str, str] = {
    "not run": "#e6e6e6",
    "ok": "#2ca02c",
    "unsupported": "#9ecae1",
    "slow": "#ff9f1c",
    "mismatch": "#8e44ad",
    "error": "#d62728",
}
NOT_RUN = 0  # code of an empty cell; status codes are 1 + their index in SEVERITY


def stack_label(stack: tuple[str, ...]) -> str:
    """("vmap", "grad") -> "vmap(grad)"; () -> "eager"."""
    if not stack:
        return "eager"
    return "(".join(stack) + ")" * (len(stack) - 1)


def render_matrix_png(
    entries: Sequence[MatrixEntry], path: str | Path, *, title: str = "multicomposite verified matrix"
) -> Path:
    """Write the matrix heatmap as a PNG at ``path`` and return it."""
    if not entries:
        raise ValueError("no entries to plot")
    # Imported here so that importing registry never pulls matplotlib in. An Agg canvas on a bare Figure needs no
    # display and leaves pyplot's global backend and figure list alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rank = {status: i + 1 for i, status in enumerate(SEVERITY)}
    worst: dict[tuple[str, tuple[str, ...]], int] = {}
    for entry in entries:
        if entry.status not in rank:
            raise ValueError(f"invalid status {entry.status!r}; valid: {', '.join(SEVERITY)}")
        key = (f"{entry.op}/{entry.composite}", tuple(entry.stack))
        worst[key] = max(worst.get(key, NOT_RUN), rank[entry.status])

    rows = sorted({row for row, _ in worst})
    # Eager first, then shallower stacks before deeper ones.
    stacks = sorted({stack for _, stack in worst}, key=lambda s: (len(s), s))
    grid = [[worst.get((row, stack), NOT_RUN) for stack in stacks] for row in rows]

    order = ("not run", *SEVERITY)
    cmap = ListedColormap([COLOURS[name] for name in order])
    norm = BoundaryNorm([i - 0.5 for i in range(len(order) + 1)], cmap.N)

    # About a third of an inch per cell, plus room for the labels, so ~30 x 60 stays readable.
    col_labels = [stack_label(stack) for stack in stacks]
    row_chars = max(len(row) for row in rows)
    col_chars = max(len(label) for label in col_labels)
    width = max(6.0, 0.32 * len(stacks) + 0.09 * row_chars + 2.5)
    height = max(4.0, 0.32 * len(rows) + 0.08 * col_chars + 2.0)
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.imshow(grid, cmap=cmap, norm=norm, aspect="equal", interpolation="nearest")
    ax.set_xticks(range(len(stacks)), labels=col_labels, rotation=60, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(rows)), labels=rows)
    ax.tick_params(axis="both", labelsize=8)
    # White minor-grid lines separate the cells, which matters when neighbours share a colour.
    ax.set_xticks([i - 0.5 for i in range(len(stacks) + 1)], minor=True)
    ax.set_yticks([i - 0.5 for i in range(len(rows) + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("transform stack")
    ax.set_ylabel("op/composite")
    ax.set_title(title)
    handles = [Patch(facecolor=COLOURS[name], edgecolor="#555555", label=name) for name in (*SEVERITY, "not run")]
    ax.legend(handles=handles, title="worst status", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100, bbox_inches="tight")
    return out


# --- the speedup report ----------------------------------------------------------------------------------------------

# Statuses that make a composite invalid where they were measured: the selector never chooses it there.
INVALID_STATUSES: tuple[str, ...] = FAILING
# An invalid composite's bar spans 1/INVALID_SPAN .. INVALID_SPAN around 1x: a marker, not a speed.
INVALID_SPAN = 1.25
INVALID_COLOUR = "#bdbdbd"
INVALID_HATCH = "xx"
REMEASURED_HATCH = "//"


@dataclass(frozen=True)
class SpeedupBar:
    """One bar of the report: a non-native composite in one context (op, workload, dtype, device; the largest batch
    and size profiled there), as a speedup over native or as invalid."""

    op: str
    workload: str
    dtype: str
    device: str
    batch_size: int
    numel_bucket: int
    composite: str
    kind: str
    speedup: float | None  # native median / composite median; None when invalid or native has no timing
    low: float | None  # the ratio's low and high ends: each median -+ half its IQR
    high: float | None
    remeasured: bool  # this context was re-measured (the first run was disturbed)
    invalid: str | None  # why this composite is not a speed here, or None
    native_invalid: str | None  # why native itself is invalid here (its time is still the 1x reference), or None


def _speedup_with_spread(native: Any, composite: Any) -> tuple[float, float, float]:
    """(native median / composite median, and the ratio's low and high ends): each median +- half its IQR."""
    ratio = native.median_us / composite.median_us
    native_half, composite_half = (native.iqr_us or 0.0) / 2, (composite.iqr_us or 0.0) / 2
    low = max(native.median_us - native_half, 0.0) / (composite.median_us + composite_half)
    high = (native.median_us + native_half) / max(composite.median_us - composite_half, 1e-9)
    return ratio, low, high


def remeasured(profiles: Sequence[Any]) -> list[str]:
    """One line per context (op, workload, batch, dtype) whose timings were re-measured because the first run was
    disturbed, saying why (from the entries' ``detail``)."""
    lines = {}
    for p in profiles:
        if p.valid and p.detail.startswith("re-measured"):
            why = p.detail.split("; first call")[0]
            key = (p.op, p.workload, p.batch_size, p.dtype)
            lines[key] = f"{p.op} {p.workload} batch {p.batch_size} {p.dtype}: {why}"
    return [lines[key] for key in sorted(lines)]


def _matrix_index(matrix: Iterable[MatrixEntry]) -> dict[tuple[str, str, tuple[str, ...], str], list[MatrixEntry]]:
    index: dict[tuple[str, str, tuple[str, ...], str], list[MatrixEntry]] = {}
    for entry in matrix:
        index.setdefault((entry.op, entry.composite, tuple(entry.stack), entry.dtype), []).append(entry)
    return index


def matrix_problem(index: Mapping[tuple[str, str, tuple[str, ...], str], Sequence[MatrixEntry]], profile: Any
                   ) -> str | None:
    """Why the verified matrix says ``profile``'s composite is invalid in its context, or None.

    A profile batches every tensor argument (pattern ``all`` or ``in_dims1`` under vmap, ``-`` without), and its
    stack is the one the op saw (``autograd`` is not a matrix transform: left out, as the selector does).
    """
    stack = tuple(t for t in profile.stack if t != "autograd")
    patterns = ("all", "in_dims1") if "vmap" in stack else ("-",)
    failing = [e for e in index.get((profile.op, profile.composite, stack, profile.dtype), ())
               if e.status in INVALID_STATUSES and e.pattern in patterns]
    if not failing:
        return None
    status = worst(e.status for e in failing)
    chosen = next(e for e in failing if e.status == status)
    return f"{status} in the verified matrix under {stack_label(stack)}, pattern {chosen.pattern}"


def speedup_bars(profiles: Sequence[Any], matrix: Iterable[MatrixEntry] = ()) -> list[SpeedupBar]:
    """The report's bars: per context (op, workload, dtype, device) at its largest batch (and, at that batch, its
    largest size), each non-native composite's speedup over native with its spread, or why it is invalid there: its
    profile is invalid (it raised or differed from the functional composite), or ``matrix`` (the verified matrix)
    has a failing entry for it in that context. Ordered by op, workload, dtype, device, composite."""
    index = _matrix_index(matrix)
    largest: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for p in profiles:
        key = (p.op, p.workload, p.dtype, p.device)
        largest[key] = max(largest.get(key, (0, 0)), (p.batch_size, p.numel_bucket))
    chosen = [p for p in profiles if (p.batch_size, p.numel_bucket) == largest[(p.op, p.workload, p.dtype, p.device)]]
    natives = {(p.op, p.workload, p.dtype, p.device): p for p in chosen if p.kind == "native"}
    bars = []
    for p in sorted(chosen, key=lambda p: (p.op, p.workload, p.dtype, p.device, p.composite)):
        if p.kind == "native":
            continue
        native = natives.get((p.op, p.workload, p.dtype, p.device))
        native_ok = native is not None and native.valid and bool(native.median_us)
        native_invalid = None
        if native is not None:
            native_invalid = (f"profile invalid: {native.detail}" if not native.valid
                              else matrix_problem(index, native))
        invalid = f"profile invalid: {p.detail}" if not p.valid else matrix_problem(index, p)
        speedup = low = high = None
        if invalid is None and native_ok and p.median_us:
            speedup, low, high = _speedup_with_spread(native, p)
        again = p.valid and (p.detail.startswith("re-measured")
                             or (native is not None and native.valid and native.detail.startswith("re-measured")))
        bars.append(SpeedupBar(op=p.op, workload=p.workload, dtype=p.dtype, device=p.device, batch_size=p.batch_size,
                               numel_bucket=p.numel_bucket, composite=p.composite, kind=p.kind, speedup=speedup,
                               low=low, high=high, remeasured=again, invalid=invalid,
                               native_invalid=native_invalid))
    return bars


def speedup_lines(profiles: Sequence[Any], matrix: Iterable[MatrixEntry] = ()) -> list[str]:
    """The report's bars as text: speedup over native with its low..high range (re-measured ones marked), or why
    the composite is invalid, or that native has no timing to compare with."""
    lines = []
    for bar in speedup_bars(profiles, matrix):
        head = f"  {bar.op:15s} {bar.workload:11s} {bar.composite:11s}"
        if bar.invalid is not None:
            lines.append(f"{head} invalid: {bar.invalid}")
        elif bar.speedup is None:
            lines.append(f"{head} no valid native timing to compare with")
        else:
            lines.append(f"{head} {bar.speedup:7.2f}x  [{bar.low:.2f} .. {bar.high:.2f}]"
                         f"{'  (re-measured)' if bar.remeasured else ''}")
    return lines


def _ratio_label(value: float) -> str:
    """Tick and bar labels: 1x, 2x, 0.5x, 1.37x."""
    return f"{value:.3g}x" if value < 10 else f"{value:.0f}x"


def speedup_figure(bars: Sequence[SpeedupBar], *, title: str = "multicomposite: speedup over native") -> Any:
    """A matplotlib Figure of ``bars``: on a log axis centred on 1x, each composite's bar starts at 1x and ends at
    its speedup (faster above, slower below), with a value label beyond its error bar (median +- IQR/2 of both
    timings); an invalid composite is a grey hatched marker around 1x labelled "invalid"; a context that was
    re-measured has hatched bars. Inspect it (``figure.axes[0]``) or save it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    shown = [bar for bar in bars if bar.speedup is not None or bar.invalid is not None]
    if not shown:
        raise ValueError("no timed or invalid composites to plot: profile them first (multicomposite profile)")
    groups = list(dict.fromkeys((b.op, b.workload, b.dtype, b.device) for b in shown))
    names = sorted({b.composite for b in shown})
    several_dtypes = len({b.dtype for b in shown}) > 1
    several_devices = len({b.device for b in shown}) > 1
    width = 0.8 / len(names)
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
    colours = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    figure = Figure(figsize=(min(max(8.0, 0.45 * len(shown) + 2.0), 26.0), 7.0))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    extent = INVALID_SPAN
    rotate = 90 if len(shown) > 10 else 0
    for bar in shown:
        x = groups.index((bar.op, bar.workload, bar.dtype, bar.device)) + (names.index(bar.composite)
                                                                          - (len(names) - 1) / 2) * width
        if bar.invalid is not None:
            drawn = axes.bar([x], [INVALID_SPAN - 1 / INVALID_SPAN], bottom=1 / INVALID_SPAN, width=width,
                             color=INVALID_COLOUR, edgecolor="#7f7f7f", hatch=INVALID_HATCH, linewidth=0.6)
            drawn.patches[0].set_gid(f"invalid:{bar.op}/{bar.composite}/{bar.workload}")
            axes.annotate("invalid", (x, INVALID_SPAN), xytext=(0, 3), textcoords="offset points", ha="center",
                          va="bottom", fontsize=7, color="#555555", rotation=rotate)
            continue
        speedup = bar.speedup if bar.speedup is not None else 1.0  # shown: valid bars have a speedup
        low = bar.low if bar.low is not None else speedup
        high = bar.high if bar.high is not None else speedup
        drawn = axes.bar([x], [speedup - 1.0], bottom=1.0, width=width, color=colours[bar.composite],
                         edgecolor="#333333", linewidth=0.5, hatch=REMEASURED_HATCH if bar.remeasured else "",
                         yerr=[[speedup - low], [high - speedup]], capsize=2,
                         error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        drawn.patches[0].set_gid(f"speedup:{bar.op}/{bar.composite}/{bar.workload}")
        faster = speedup >= 1.0
        axes.annotate(_ratio_label(speedup), (x, high if faster else low),
                      xytext=(0, 3 if faster else -3), textcoords="offset points", ha="center",
                      va="bottom" if faster else "top", fontsize=7, rotation=rotate)
        extent = max(extent, high, 1.0 / max(low, 1e-9))
    # Centred on 1x: as far below as above, with room for the labels.
    extent = extent ** 1.25
    axes.set_yscale("log")
    axes.set_ylim(1.0 / extent, extent)
    # Ticks mirrored around 1x (2x above, 0.5x below); the fine steps only while the range is narrow.
    steps = [v for v in (1.25, 1.5, 2.0, 4.0, 10.0, 30.0, 100.0, 1000.0) if v < extent]
    if len(steps) > 4:
        steps = [v for v in steps if v >= 2.0]
    axes.yaxis.set_major_locator(FixedLocator(sorted([1.0, *steps, *(1.0 / v for v in steps)])))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _ratio_label(value)))
    axes.yaxis.set_minor_locator(NullLocator())
    axes.axhline(1.0, color="black", linewidth=0.9)
    axes.text(0.005, 0.99, "faster than native", transform=axes.transAxes, ha="left", va="top", fontsize=8,
              color="#2ca02c")
    axes.text(0.005, 0.01, "slower than native", transform=axes.transAxes, ha="left", va="bottom", fontsize=8,
              color="#d62728")

    def group_label(op: str, workload: str, dtype: str, device: str) -> str:
        extra = " ".join(value for value, several in ((dtype, several_dtypes), (device, several_devices)) if several)
        natives = {b.native_invalid for b in shown if (b.op, b.workload, b.dtype, b.device) == (op, workload, dtype,
                                                                                                 device)}
        flag = "\n(native invalid)" if natives - {None} else ""
        return f"{op}\n{workload}{' ' + extra if extra else ''}{flag}"

    axes.set_xticks(range(len(groups)))
    axes.set_xticklabels([group_label(*group) for group in groups], rotation=60 if len(groups) > 6 else 0,
                         ha="right" if len(groups) > 6 else "center", fontsize=7)
    axes.set_xlim(-0.6, len(groups) - 0.4)
    axes.set_ylabel("speedup over native (native median / composite median, log scale)\n"
                    "error bars: each median +- IQR/2")
    hatched = any(b.remeasured for b in shown)
    axes.set_title(title + ("\n(hatched //: re-measured, the first run was disturbed)" if hatched else ""))
    handles = [Patch(facecolor=colours[name], edgecolor="#333333", label=name) for name in names
               if any(b.composite == name and b.invalid is None for b in shown)]
    if any(b.invalid is not None for b in shown):
        handles.append(Patch(facecolor=INVALID_COLOUR, edgecolor="#7f7f7f", hatch=INVALID_HATCH,
                             label="invalid (not a speed)"))
    axes.legend(handles=handles, title="composite", fontsize=8, loc="upper right")
    figure.tight_layout()
    return figure


def render_speedups_png(profiles: Sequence[Any], path: str | Path, *, matrix: Iterable[MatrixEntry] = (),
                        title: str = "multicomposite: speedup over native",
                        bars: Sequence[SpeedupBar] | None = None) -> Path:
    """Write ``speedup_figure`` of ``profiles`` (checked against ``matrix``) as a PNG at ``path``; return it.
    ``bars``: ``speedup_bars(profiles, matrix)`` where the caller has them already."""
    figure = speedup_figure(speedup_bars(profiles, matrix) if bars is None else bars, title=title)
    out = Path(path)
    figure.savefig(out, dpi=110)
    return out
