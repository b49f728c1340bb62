"""Plain-text Gantt chart for the terminal: one line per rank, time quantised to columns.

Each column covers the same slice of time in every panel, so stacked panels (several
schedules, or predicted over measured) line up. A column shows the op that occupies most of
it, or '.' when the rank is idle for at least half of it; microbatch numbers are written into
boxes wide enough to hold them. This keeps p=32, m=256 to 32 lines of terminal width: detail
is lost to quantisation, never to wrapping.
"""

from __future__ import annotations

import math

from ..actions import Op
from .gantt import LANE_CHARS, LANE_NAMES, OP_NAMES, PAIR, Panel, key_order, nice_ticks, op_char, tick_label

__all__ = ["render_text"]

_IDLE = "."
_MIXED = "#"
_DOMINANT = 0.6  # share of a column's busy time one op needs to name the column
_MIN_COLUMNS = 10
_MAX_ROWS = 64  # per panel; beyond this the middle ranks are elided
# odd chunks use the bright variant (+60)
_ANSI: dict[str, int] = {Op.F: 34, Op.B: 33, Op.W: 32, Op.BW: 35, Op.R: 31, Op.RS: 31, PAIR: 36}


def _row_cells(bars, ncols: int, dt: float) -> tuple[list[str], list[tuple[str, int] | None]]:
    occupancy: list[dict[tuple[str, int], float]] = [{} for _ in range(ncols)]
    nbars = [0] * ncols
    for b in bars:
        key = b.key
        for c in range(int(b.start / dt), min(ncols - 1, int(b.end / dt)) + 1):
            overlap = min(b.end, (c + 1) * dt) - max(b.start, c * dt)
            if overlap > 0:
                occupancy[c][key] = occupancy[c].get(key, 0.0) + overlap
                nbars[c] += 1
    keys: list[tuple[str, int] | None] = []
    chars = []
    for occ, n in zip(occupancy, nbars):
        busy = sum(occ.values())
        top = max(occ, key=lambda k: occ[k]) if occ else None
        # A column holding several passes of different ops gets '#': its majority op would
        # alias with the steady-state period and draw long false runs of one letter. Two
        # passes meeting in a column are just a boundary; the larger one names it.
        mixed = top is not None and n > 2 and occ[top] < _DOMINANT * busy
        keys.append(top if busy >= dt / 2 and not mixed else None)
        if busy < dt / 2:
            chars.append(_IDLE)
        else:
            assert top is not None  # a busy column holds some pass
            chars.append(_MIXED if mixed else op_char(*top))
    for b in bars:
        # Cells whose centre the bar covers are the bar's own; label it if they hold "F12".
        first = math.ceil(b.start / dt - 0.5)
        last = min(ncols - 1, math.ceil(b.end / dt - 0.5) - 1)
        label = b.label
        letter = op_char(*b.key)
        if last - first >= len(label) and all(ch == letter for ch in chars[first : last + 1]):
            chars[first + 1 : first + 1 + len(label)] = label
    return chars, keys


def _lane_cells(lane: list[tuple[str, int, float, float]], ncols: int, dt: float) -> str:
    """A rank's lane as one line: each column the kind of lane work that covers most of it
    (``LANE_CHARS``), blank where there is none."""
    cover: list[dict[str, float]] = [{} for _ in range(ncols)]
    for kind, _, a, b in lane:
        for c in range(max(0, int(a / dt)), min(ncols - 1, int(b / dt)) + 1):
            overlap = min(b, (c + 1) * dt) - max(a, c * dt)
            if overlap > 0:
                cover[c][kind] = cover[c].get(kind, 0.0) + overlap
    return "".join(LANE_CHARS[max(occ, key=lambda k: occ[k])] if occ else " " for occ in cover).rstrip()


def _colourise(chars: list[str], keys: list[tuple[str, int] | None]) -> str:
    out, i = [], 0
    while i < len(chars):
        j = i
        while j < len(chars) and keys[j] == keys[i]:
            j += 1
        run = "".join(chars[i:j])
        key = keys[i]
        if key is None:
            out.append(run)
        else:
            op, chunk = key
            out.append(f"\x1b[{_ANSI[op] + 60 * (chunk % 2)}m{run}\x1b[0m")
        i = j
    return "".join(out)


def _axis(ncols: int, dt: float, end: float, pad: str) -> list[str]:
    ticks = nice_ticks(end, max(1, ncols // 12))
    rule = ["-"] * ncols
    labels = [" "] * (ncols + 4)
    free_from = 0
    for t in ticks:
        c = min(ncols - 1, round(t / dt))
        rule[c] = "+"
        text = tick_label(t)
        if c >= free_from and c + len(text) <= ncols:
            labels[c : c + len(text)] = text
            free_from = c + len(text) + 1
    label_line = "".join(labels).rstrip()
    return [pad + " " + "".join(rule), pad + " " + label_line + " ms"]


def _legend(panels: list[Panel], dt: float) -> str:
    ops = sorted({op for p in panels for op, _ in p.ops()}, key=key_order)
    parts = [f"{op_char(op, 0)} {OP_NAMES[op]}" for op in ops] + [f"{_MIXED} mixed", f"{_IDLE} idle", "digits: microbatch"]
    if any(p.chunks > 1 for p in panels):
        parts.append("lower case: odd chunk")
    on_lane = {kind for p in panels for r in range(p.num_ranks) for kind, _, _, _ in p.lane(r)}
    parts += [f"{LANE_CHARS[kind]} {name}" for kind, name in LANE_NAMES.items() if kind in on_lane]
    parts.append(f"1 column = {dt:.3g} ms")
    return "   ".join(parts)


def render_text(panels: list[Panel], width: int = 120, title: str | None = None, colour: bool = False) -> str:
    """The panels stacked on one time scale, ``width`` characters wide (ANSI colours optional)."""
    max_rank = max(p.num_ranks for p in panels) - 1
    label_w = len(f"r{max_rank}") + 1
    ncols = max(_MIN_COLUMNS, width - label_w - 1)
    end = max((p.end for p in panels), default=0.0) or 1.0
    dt = end / ncols
    pad = " " * label_w
    lines = [title] if title else []
    for panel in panels:
        lines.append(panel.title())
        ranks = list(range(panel.num_ranks))
        if len(ranks) > _MAX_ROWS:
            ranks = ranks[: _MAX_ROWS // 2] + [-1] + ranks[-(_MAX_ROWS // 2 - 1) :]
        for r in ranks:
            if r < 0:
                lines.append(f"{'':<{label_w}}: {panel.num_ranks - _MAX_ROWS + 1} ranks not shown")
                continue
            chars, keys = _row_cells(panel.rows[r], ncols, dt)
            body = _colourise(chars, keys) if colour else "".join(chars)
            lines.append(f"{f'r{r}':<{label_w}}|{body}")
            if panel.has_lane:  # under the rank's passes: its gathers and reductions
                lines.append(f"{'':<{label_w}}:{_lane_cells(panel.lane(r), ncols, dt)}")
    lines += _axis(ncols, dt, end, pad)
    lines.append(_legend(panels, dt))
    return "\n".join(lines)
