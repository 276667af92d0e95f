"""Gantt charts of one simulated step: per GPU, when it computes, waits on communication,
waits on offload copies, or idles — one panel per strategy, on one time axis.

Each micro-batch is drawn as its compute first, then its exposed communication, then its
exposed offload copy; the rest of its span (waiting for ring partners) and the gaps between
micro-batches are idle. With more GPUs than ``max_rows``, evenly spaced GPUs are shown (the
title says which); the dashed line marks the lower bound, dotted lines the barriers. The legend
and the title name only what is drawn.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .timeline import BACKWARD, FORWARD, Timeline  # noqa: E402

COLORS = {
    "forward": "#74a9cf",
    "backward": "#0570b0",
    "comm": "#e34a33",
    "offload": "#fdae61",
    "a2a": "#8856a7",  # two-level attention's head all-to-all inside the node
}


def sampled_rows(total: int, max_rows: int) -> np.ndarray:
    if total <= max_rows:
        return np.arange(total)
    return np.unique(np.linspace(0, total - 1, max_rows).round().astype(int))


def _row_label(row: int, timeline: Timeline) -> str:
    rank, stage = row % timeline.num_ranks, row // timeline.num_ranks
    return f"r{rank}" if timeline.stages == 1 else f"r{rank}/s{stage}"


def plot_timelines(
    timelines: dict[str, Timeline],
    path: str | Path,
    lower_bound: float | None = None,
    max_rows: int = 48,
    title: str = "",
) -> Path:
    """Write one PNG with a Gantt panel per strategy; returns the path."""
    names = list(timelines)
    heights = [min(max_rows, len(t.ops)) for t in timelines.values()]
    steps = [t.step_time for t in timelines.values()]
    shared = max(steps) <= 3 * max(min(steps), 1e-12)  # one axis unless an outlier would squash the rest
    fig, axes = plt.subplots(
        len(names),
        1,
        figsize=(14, 1.2 + sum(0.12 * h + 0.8 for h in heights)),
        sharex=shared,
        squeeze=False,
        gridspec_kw={"height_ratios": [h + 4 for h in heights]},
    )
    horizon = max(t.step_time for t in timelines.values()) or 1.0
    drawn: set[str] = set()  # the legend and the title name only what some panel shows
    barriers = False
    for ax, name in zip(axes[:, 0], names):
        t = timelines[name]
        rows = sampled_rows(len(t.ops), max_rows)
        bars: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in COLORS}
        for _y, row in enumerate(rows):
            spans = {k: [] for k in COLORS}
            for start, _end, direction, compute, comm, offload, *more in t.ops[row]:
                a2a = more[0] if more else 0.0
                kind = "forward" if int(direction) == FORWARD else "backward"
                spans[kind].append((start, compute))
                if comm > 0:
                    spans["comm"].append((start + compute, comm))
                if offload > 0:
                    spans["offload"].append((start + compute + comm, offload))
                if a2a > 0:
                    spans["a2a"].append((start + compute + comm + offload, a2a))
            for k in COLORS:
                bars[k].append(spans[k])
        for y in range(len(rows)):
            for k, color in COLORS.items():
                if bars[k][y]:
                    ax.broken_barh(bars[k][y], (y - 0.4, 0.8), facecolors=color, linewidth=0)
                    drawn.add(k)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        step = len(t.ops) // len(rows) if len(rows) < len(t.ops) else 1
        shown = "all" if len(rows) == len(t.ops) else f"{len(rows)} of {len(t.ops)}, evenly spaced (~1 in {step})"
        ax.set_title(f"{name}: step {t.step_time:.2f} s; GPUs shown: {shown}", fontsize=10, loc="left")
        ticks = np.unique(np.linspace(0, len(rows) - 1, min(len(rows), 12)).round().astype(int))
        ax.set_yticks(ticks)
        ax.set_yticklabels([_row_label(int(rows[i]), t) for i in ticks], fontsize=7)
        ax.axvline(t.step_time, color="black", linewidth=1)
        if lower_bound:
            ax.axvline(lower_bound, color="black", linestyle="--", linewidth=1)
        for b in t.barriers:
            ax.axvline(b, color="black", linestyle=":", linewidth=1, zorder=5)
            barriers = True
        if not shared:
            ax.set_xlim(0, t.step_time * 1.02)
    if shared:
        axes[-1, 0].set_xlim(0, horizon * 1.02)
    axes[-1, 0].set_xlabel("seconds into the step" + ("" if shared else " (each panel on its own time axis)"))
    handles = [
        Patch(
            color=c, label={"a2a": "exposed all-to-all"}.get(k, k if k not in ("comm", "offload") else f"exposed {k}")
        )
        for k, c in COLORS.items()
        if k in drawn
    ]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="idle"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    note = "; ".join(
        text for text, shown in (("dashed: lower bound", bool(lower_bound)), ("dotted: barriers", barriers)) if shown
    )
    fig.suptitle("\n".join(filter(None, (title, note))), fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["BACKWARD", "FORWARD", "plot_timelines", "sampled_rows"]
