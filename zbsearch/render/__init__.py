"""Gantt charts of pipeline schedules: predicted timelines, measured traces, or both.

``gantt`` turns a schedule (through the simulator) or a runtime trace into backend-neutral
panels; ``text``, ``figure`` (PNG/SVG through matplotlib) and ``html`` (self-contained, with
hover tooltips) only draw them. matplotlib is imported only when a PNG/SVG is written, so the
CLI and the text chart stay fast.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ZbError
from .gantt import Bar, Panel, intervals_panel, schedule_panel
from .measured import load_measured, with_measured
from .text import render_text

__all__ = [
    "Bar",
    "Panel",
    "schedule_panel",
    "intervals_panel",
    "load_measured",
    "with_measured",
    "render_text",
    "write_chart",
    "CHART_SUFFIXES",
]

CHART_SUFFIXES = (".png", ".svg", ".html")


def write_chart(panels: list[Panel], path: str | os.PathLike, title: str | None = None) -> Path:
    """Draw ``panels`` stacked on one time axis into ``path``; the suffix picks the format."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in CHART_SUFFIXES:
        raise ZbError(f"{p}: cannot tell the chart format from {suffix or 'no suffix'!r}; use one of {', '.join(CHART_SUFFIXES)}")
    if not p.parent.is_dir():
        raise ZbError(f"{p}: folder {p.parent} does not exist")
    if suffix == ".html":
        from .html import write_html

        write_html(panels, p, title)
    else:
        from .figure import write_figure

        write_figure(panels, p, title)
    return p
