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


def render_speedups_png(profiles: Sequence[Any], path: str | Path, *,
                        title: str = "multicomposite: speedup over native") -> Path:
    """Bars of native's median over each valid composite's, per op and workload (largest batch), log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timed = [p for p in profiles if p.valid and p.median_us]
    if not timed:
        raise ValueError("no timed profiles to plot")
    largest = {}
    for p in timed:
        key = (p.op, p.workload)
        largest[key] = max(largest.get(key, 0), p.batch_size)
    groups = sorted(largest)
    native = {(p.op, p.workload): p.median_us for p in timed
              if p.kind == "native" and p.batch_size == largest[(p.op, p.workload)]}
    names = sorted({p.composite for p in timed if p.kind != "native"})
    figure = Figure(figsize=(min(max(10.0, 0.35 * len(groups)), 26.0), 6.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys = [], []
        for g, key in enumerate(groups):
            match = [p for p in timed if (p.op, p.workload) == key and p.composite == name
                     and p.batch_size == largest[key]]
            if match and key in native:
                xs.append(g + i * width)
                ys.append(native[key] / match[0].median_us)
        axes.bar(xs, ys, width=width, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    axes.set_xticklabels([f"{op}\n{workload}" for op, workload in groups], rotation=60, ha="right", fontsize=7)
    axes.set_ylabel("speedup over native (native median / composite median)")
    axes.set_title(title)
    axes.legend(title="composite", fontsize=8)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    return out
