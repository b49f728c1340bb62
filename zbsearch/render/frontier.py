"""The frontier as a plot: bubble rate and its lower bound against the memory limit."""

from __future__ import annotations

import io
import os
from pathlib import Path

from ..formats.fileio import write_bytes
from ..formats.frontier import Frontier

__all__ = ["save_frontier_plot"]


def save_frontier_plot(fr: Frontier, path: str | os.PathLike) -> None:
    """Bubble rate and its lower bound against the limit (PNG, SVG or PDF by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [pt.limit for pt in fr.points]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(xs, [pt.bubble_rate for pt in fr.points], "o-", label="best schedule found")
    ax.plot(xs, [pt.bound_bubble_rate for pt in fr.points], "--", color="grey", label="lower bound")
    ax.axhline(fr.unlimited_bubble_rate, color="green", lw=0.8, ls=":", label="no memory limit")
    ax.set_xlabel("memory limit (x p M_B per rank)")
    ax.set_ylabel("bubble rate")
    ax.set_title(f"{fr.profile}, m={fr.num_microbatches}, {fr.chunks} chunk{'s' * (fr.chunks > 1)}, {fr.objective}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()  # drawn in memory, then written atomically (see fileio.write_bytes)
    fig.savefig(buf, format=Path(path).suffix.lower().lstrip("."))
    plt.close(fig)
    write_bytes(path, buf.getvalue())
