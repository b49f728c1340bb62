"""PNG and SVG Gantt charts through matplotlib, in the style of the Zero Bubble paper's figures.

Uses a bare ``Figure`` with the Agg canvas rather than pyplot, so writing a chart never
touches a global backend or leaks figures in a long-lived process. One ``broken_barh``
collection per rank keeps p=32, m=256 (~25k boxes) to about a second.
"""

from __future__ import annotations

import io
from pathlib import Path

from ..formats.fileio import write_bytes
from .gantt import LANE_COLOURS, LANE_NAMES, OP_NAMES, Panel, colour, key_order, text_colour

__all__ = ["write_figure"]

_WIDTH_IN = 14.0
_DPI = 150


def _row_height_in(total_rows: int) -> float:
    return max(0.1, min(0.32, 20.0 / total_rows))


def _draw_panel(ax, panel: Panel, end: float, axes_px: float, row_in: float) -> None:
    row_pt = row_in * 72 * 0.8
    font_pt = min(8.0, 0.6 * row_pt)
    char_px = 0.62 * font_pt * _DPI / 72
    px_per_ms = axes_px / end
    thin = any(row and min(b.end - b.start for b in row) * px_per_ms < 4 for row in panel.rows)
    for r, row in enumerate(panel.rows):
        fills = [colour(*b.key) for b in row]
        ax.broken_barh(
            [(b.start, b.end - b.start) for b in row], (r - 0.4, 0.8), facecolors=fills,
            edgecolors="white", linewidth=0 if thin else 0.6,
        )
        if font_pt < 4:
            continue
        for b, fill in zip(row, fills):
            label = b.label
            if (b.end - b.start) * px_per_ms >= len(label) * char_px + 3:
                ax.text((b.start + b.end) / 2, r, label, ha="center", va="center", fontsize=font_pt, color=text_colour(fill))
    for r in range(panel.num_ranks):  # the lane, in the gap below the rank's row: gathers, then reductions
        lane = panel.lane(r)
        if lane:
            ax.broken_barh([(a, b - a) for _, _, a, b in lane], (r + 0.41, 0.08),
                           facecolors=[LANE_COLOURS[kind] for kind, _, _, _ in lane], edgecolors="white", linewidth=0.4)
    ax.set_ylim(panel.num_ranks - 0.5, -0.5)
    ax.set_yticks(range(panel.num_ranks), [str(r) for r in range(panel.num_ranks)], fontsize=min(9, max(5, row_pt * 0.7)))
    ax.set_ylabel("rank")
    ax.set_title(panel.title(), loc="left", fontsize=10)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)


def write_figure(panels: list[Panel], path: Path, title: str | None = None) -> None:
    """Draw ``panels`` stacked on one time axis with matplotlib; the format follows the suffix (.png, .svg, ...)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    total_rows = sum(p.num_ranks for p in panels)
    row_in = _row_height_in(total_rows)
    height = total_rows * row_in + 0.75 * len(panels) + 0.8 + (0.4 if title else 0.0)
    fig = Figure(figsize=(_WIDTH_IN, height), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=[p.num_ranks + 1.2 for p in panels])[:, 0]
    end = max(p.end for p in panels) or 1.0
    axes_px = 0.9 * _WIDTH_IN * _DPI  # constrained layout leaves ~10% for the rank labels
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, end, axes_px, row_in)
    axes[-1].set_xlim(0, end)
    axes[-1].set_xlabel("time (ms)")
    chunks = max(p.chunks for p in panels)
    keys = sorted({k for p in panels for k in p.ops()}, key=lambda oc: (oc[1], key_order(oc[0])))
    handles = [
        Patch(color=colour(op, c), label=f"{op} {OP_NAMES[op]}" + (f", chunk {c}" if chunks > 1 else ""))
        for op, c in keys
    ]
    on_lane = {kind for p in panels for r in range(p.num_ranks) for kind, _, _, _ in p.lane(r)}
    handles += [Patch(color=LANE_COLOURS[kind], label=name) for kind, name in LANE_NAMES.items() if kind in on_lane]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8), frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=12)
    buf = io.BytesIO()  # drawn in memory, then written atomically (see fileio.write_bytes)
    fig.savefig(buf, dpi=_DPI, format=Path(path).suffix.lower().lstrip("."))
    write_bytes(path, buf.getvalue())
