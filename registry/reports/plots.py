"""A heatmap of the compatibility matrix: op/composite rows, transform-stack columns, worst status per cell."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from registry.store.db import MatrixEntry

# Worst last: a cell shows the worst status over its patterns and dtypes.
SEVERITY: tuple[str, ...] = ("ok", "unsupported", "slow", "mismatch", "error")
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


def speedup_rows(profiles: Sequence[Any]) -> list[tuple[str, str, str, float, float, float, bool]]:
    """(op, workload, composite, speedup, low, high, re-measured) per valid non-native composite at each (op,
    workload)'s largest batch: what the report plots."""
    timed = [p for p in profiles if p.valid and p.median_us]
    largest: dict[tuple[str, str], int] = {}
    for p in timed:
        key = (p.op, p.workload)
        largest[key] = max(largest.get(key, 0), p.batch_size)
    native = {(p.op, p.workload): p for p in timed
              if p.kind == "native" and p.batch_size == largest[(p.op, p.workload)]}
    rows = []
    for p in sorted(timed, key=lambda p: (p.op, p.workload, p.composite)):
        key = (p.op, p.workload)
        if p.kind == "native" or p.batch_size != largest[key] or key not in native:
            continue
        ratio, low, high = _speedup_with_spread(native[key], p)
        again = p.detail.startswith("re-measured") or native[key].detail.startswith("re-measured")
        rows.append((p.op, p.workload, p.composite, ratio, low, high, again))
    return rows


def speedup_lines(profiles: Sequence[Any]) -> list[str]:
    """The report's bars as text: speedup over native with its low..high range, re-measured ones marked."""
    return [f"  {op:15s} {workload:11s} {name:11s} {ratio:7.2f}x  [{low:.2f} .. {high:.2f}]"
            f"{'  (re-measured)' if again else ''}"
            for op, workload, name, ratio, low, high, again in speedup_rows(profiles)]


def render_speedups_png(profiles: Sequence[Any], path: str | Path, *,
                        title: str = "multicomposite: speedup over native") -> Path:
    """Bars of native's median over each valid composite's, per op and workload (largest batch), log scale, each
    with an error bar from the two medians' spread (median +- half the IQR); a bar of a context that was re-measured
    is hatched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = speedup_rows(profiles)
    if not rows:
        raise ValueError("no timed profiles to plot")
    groups = sorted({(op, workload) for op, workload, *_ in rows})
    names = sorted({name for _, _, name, *_ in rows})
    figure = Figure(figsize=(min(max(10.0, 0.35 * len(groups)), 26.0), 6.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys, below, above, hatches = [], [], [], [], []
        for op, workload, composite, ratio, low, high, again in rows:
            if composite != name:
                continue
            xs.append(groups.index((op, workload)) + i * width)
            ys.append(ratio)
            below.append(ratio - low)
            above.append(high - ratio)
            hatches.append("//" if again else "")
        bars = axes.bar(xs, ys, width=width, label=name, yerr=[below, above], capsize=2,
                        error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    axes.set_xticklabels([f"{op}\n{workload}" for op, workload in groups], rotation=60, ha="right", fontsize=7)
    axes.set_ylabel("speedup over native (native median / composite median)\nerror bars: median +- IQR/2")
    axes.set_title(title + (" (hatched: re-measured, the first run was disturbed)"
                            if any(row[-1] for row in rows) else ""))
    axes.legend(title="composite", fontsize=8)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    return out
