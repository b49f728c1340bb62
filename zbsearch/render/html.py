"""Self-contained HTML Gantt chart: inline SVG, one ``<title>`` per box for the hover tooltip.

Written by hand rather than through matplotlib so that every box is its own element carrying
its action, start and end; browsers show ``<title>`` on hover without any script, so the file
opens offline, from a CI artifact or an e-mail, with nothing fetched from a CDN.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from ..formats.fileio import write_text
from .gantt import LANE_COLOURS, LANE_NAMES, OP_NAMES, Panel, colour, key_order, nice_ticks, text_colour, tick_label

__all__ = ["write_html"]

_CHART_W = 1100  # px for the time axis
_LEFT = 44  # rank labels
_RIGHT = 16
_AXIS_H = 30
_CHAR_W = 6.5  # px per character of the box labels (11 px sans-serif digits)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; } h2 { font-size: 1em; font-weight: normal; margin: 1.2em 0 0.3em; }
svg { width: 100%; height: auto; display: block; }
svg text { font-size: 11px; pointer-events: none; }
svg rect { stroke: #fff; stroke-width: 0.5; }
svg rect:hover { stroke: #000; stroke-width: 1.5; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 1em; height: 1em; vertical-align: -0.15em; margin-right: 0.3em; }
"""


def _panel_svg(panel: Panel, end: float, row_h: float) -> str:
    scale = _CHART_W / end
    height = panel.num_ranks * row_h + _AXIS_H
    out = [f'<svg viewBox="0 0 {_LEFT + _CHART_W + _RIGHT} {height:.0f}" xmlns="http://www.w3.org/2000/svg">']
    ticks = nice_ticks(end, 12)
    for t in ticks:
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height - _AXIS_H + 4:.0f}" stroke="#ddd" stroke-width="0.5"/>')
        out.append(f'<text x="{x:.1f}" y="{height - _AXIS_H + 16:.0f}" text-anchor="middle">{tick_label(t)}</text>')
    out.append(f'<text x="{_LEFT + _CHART_W}" y="{height - 2:.0f}" text-anchor="end">time (ms)</text>')
    for r, row in enumerate(panel.rows):
        y = r * row_h
        out.append(f'<text x="{_LEFT - 6}" y="{y + row_h * 0.5 + 4:.1f}" text-anchor="end">{r}</text>')
        for b in row:
            fill = colour(*b.key)
            x, w = _LEFT + b.start * scale, (b.end - b.start) * scale
            # Kept short: p=32, m=256 has ~25k boxes and this line is most of the file.
            tip = (
                f"{b.text} ({OP_NAMES[b.key[0]]}) on rank {r}&#10;{b.start:.3f} to {b.end:.3f} ms ({b.end - b.start:.3f} ms)"
            )
            out.append(
                f'<rect x="{x:.2f}" y="{y + 1:.1f}" width="{w:.2f}" height="{row_h - 2:.1f}" fill="{fill}">'
                f"<title>{tip}</title></rect>"
            )
            label = b.label
            if w >= len(label) * _CHAR_W + 3 and row_h >= 12:
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + row_h * 0.5 + 4:.1f}" text-anchor="middle" '
                    f'fill="{text_colour(fill)}">{label}</text>'
                )
        lane_h = max(2.0, row_h * 0.15)  # the lane: a thin strip at the foot of the rank's row
        for kind, s, t0, t1 in panel.lane(r):
            tip = f"{LANE_NAMES[kind]} of stage {s} on rank {r}&#10;{t0:.3f} to {t1:.3f} ms ({t1 - t0:.3f} ms)"
            out.append(
                f'<rect x="{_LEFT + t0 * scale:.2f}" y="{y + row_h - lane_h:.1f}" width="{(t1 - t0) * scale:.2f}" '
                f'height="{lane_h:.1f}" fill="{LANE_COLOURS[kind]}"><title>{tip}</title></rect>'
            )
    out.append("</svg>")
    return "\n".join(out)


def _legend(panels: list[Panel]) -> str:
    chunks = max(p.chunks for p in panels)
    keys = sorted({k for p in panels for k in p.ops()}, key=lambda oc: (oc[1], key_order(oc[0])))
    items = [
        f'<span><i style="background:{colour(op, c)}"></i>{op} {escape(OP_NAMES[op])}'
        + (f", chunk {c}" if chunks > 1 else "")
        + "</span>"
        for op, c in keys
    ]
    on_lane = {kind for p in panels for r in range(p.num_ranks) for kind, _, _, _ in p.lane(r)}
    items += [f'<span><i style="background:{LANE_COLOURS[kind]}"></i>{escape(name)}</span>'
              for kind, name in LANE_NAMES.items() if kind in on_lane]
    return '<p class="legend">' + "".join(items) + "<span>blank: idle</span><span>hover a box for its times</span></p>"


def write_html(panels: list[Panel], path: Path, title: str | None = None) -> None:
    """Write ``panels`` as one self-contained HTML page of SVG charts (hover a box for its times)."""
    end = max(p.end for p in panels) or 1.0
    row_h = max(6.0, min(22.0, 640.0 / sum(p.num_ranks for p in panels)))
    heading = title or "Pipeline schedules: " + ", ".join(p.kind for p in panels)
    body = [f"<h1>{escape(heading)}</h1>", _legend(panels)]
    for panel in panels:
        body.append(f"<h2>{escape(panel.title())}</h2>")
        body.append(_panel_svg(panel, end, row_h))
    doc = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(heading)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
    write_text(path, doc)
