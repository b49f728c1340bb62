"""Backend-neutral Gantt data: what every rendering (text, PNG/SVG, HTML) draws.

A ``Panel`` is one timeline, predicted or measured, reduced to bars per rank with times in
ms from the panel's first start. Colours, characters, tick positions and summary lines live
here too, so the three backends cannot disagree about what a chart says; they only decide
how to draw it. An overlapped pair (``zbsearch.costs``) is one bar holding both of its
actions, drawn in a colour of its own and labelled with both microbatches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..actions import PAIR_SEP, RECOMPUTES, Action, Op, pair_text, parse_action, parse_row
from ..formats.schedule import Schedule
from ..prediction import timeline
from ..simulator import bubble_rate
from ..tolerances import REL_TOL

__all__ = [
    "Bar",
    "Panel",
    "PAIR",
    "GATHER",
    "REDUCTION",
    "LANE_NAMES",
    "LANE_COLOURS",
    "LANE_CHARS",
    "key_order",
    "schedule_panel",
    "intervals_panel",
    "OP_NAMES",
    "nice_ticks",
    "tick_label",
    "colour",
    "text_colour",
    "op_char",
]

PAIR = "F+B"
"""The key of an overlapped pair's bar where others have their op (Op is a str, so one dict holds both)."""
GATHER, REDUCTION = "gather", "reduction"
"""The two kinds of work on a rank's lane beside its passes."""
LANE_NAMES: dict[str, str] = {GATHER: "parameter gather (sharded)", REDUCTION: "gradient reduction (data parallel)"}
LANE_COLOURS: dict[str, str] = {GATHER: "#8f7fc2", REDUCTION: "#4d4d4d"}
LANE_CHARS: dict[str, str] = {GATHER: "~", REDUCTION: "="}
OP_NAMES: dict[str, str] = {Op.F: "forward", Op.B: "input grad", Op.W: "weight grad", Op.BW: "fused B+W", Op.R: "recompute",
                            Op.RS: "selective recompute", PAIR: "overlapped forward and backward"}
# Hues in the spirit of the paper's figures; chunks of one op share a hue, later ones lighter.
# Recomputation is red: work a schedule does only for want of memory.
_BASE_COLOURS: dict[str, tuple[int, int, int]] = {
    Op.F: (0x4E, 0x79, 0xA7), Op.B: (0xF2, 0x8E, 0x2B), Op.W: (0x59, 0xA1, 0x4F), Op.BW: (0xB0, 0x7A, 0xA1),
    Op.R: (0xE1, 0x57, 0x59), Op.RS: (0x9C, 0x75, 0x5F), PAIR: (0x2A, 0x9D, 0x8F)}
# Text rendering: BW, RS and a pair get their own letters because two would not fit in one cell.
_OP_CHARS: dict[str, str] = {Op.F: "F", Op.B: "B", Op.W: "W", Op.BW: "X", Op.R: "R", Op.RS: "S", PAIR: "O"}
_KEY_ORDER = [*Op, PAIR]


def key_order(key: str) -> int:
    """Where an op (or ``PAIR``) comes in legends."""
    return _KEY_ORDER.index(key)


@dataclass(frozen=True, slots=True)
class Bar:
    """One action drawn on its rank's row, or an overlapped pair: ``action`` its forward,
    ``partner`` its backward."""

    action: Action
    chunk: int  # position of the action's stage among the stages its rank holds
    start: float  # ms from the panel's origin
    end: float
    partner: Action | None = None

    @property
    def key(self) -> tuple[str, int]:
        """(op, chunk) of the bar, ``PAIR`` for an overlapped pair: what picks its colour and letter."""
        return (self.action.op if self.partner is None else PAIR, self.chunk)

    @property
    def label(self) -> str:
        """What is written in the bar: its microbatch, or a pair's two (``"3+1"``)."""
        return str(self.action.mb) if self.partner is None else f"{self.action.mb}{PAIR_SEP}{self.partner.mb}"

    @property
    def text(self) -> str:
        """The bar's action as compact text (``"0F3+5B1"`` for a pair)."""
        return str(self.action) if self.partner is None else pair_text(self.action, self.partner)

    @property
    def actions(self) -> tuple[Action, ...]:
        """The actions the bar runs."""
        return (self.action,) if self.partner is None else (self.action, self.partner)


@dataclass(frozen=True)
class Panel:
    """One timeline: ``rows[r]`` are rank r's bars in time order."""

    kind: str
    source: str  # "predicted" or "measured"
    num_microbatches: int
    chunks: int
    rows: list[list[Bar]]
    peak_memory: str | None = None  # already formatted with its unit; a trace has none
    # per rank, its gradient reductions (stage, start, end) in ms from the panel's origin, and the
    # iteration they end (``zbsearch.reductions``); empty and None where the profile has none
    reductions: list[list[tuple[int, float, float]]] = field(default_factory=list)
    iteration: float | None = None
    # per rank, where sharded stages gather their parameters at the step's start (stage, start,
    # end), on the same lane before the passes; empty where no stage gathers
    gathers: list[list[tuple[int, float, float]]] = field(default_factory=list)
    mesh: str | None = None  # the mesh the costs are per rank of, beyond the pipeline (``ProfileMesh.describe``)

    @property
    def num_ranks(self) -> int:
        """Rows in the panel."""
        return len(self.rows)

    @property
    def span(self) -> float:
        """Longest per-rank span (first start to last end): the iteration period (see ``zbsearch.simulator``)."""
        # max over the row, not the last bar: measured bars may overlap (async work on a rank).
        return max((max(b.end for b in row) - row[0].start for row in self.rows if row), default=0.0)

    @property
    def end(self) -> float:
        """The last end on any rank (ms from the panel's origin): how wide the panel is drawn."""
        bars = max((b.end for row in self.rows for b in row), default=0.0)
        return max([bars, *(e for lane in (*self.reductions, *self.gathers) for _, _, e in lane)])

    def lane(self, r: int) -> list[tuple[str, int, float, float]]:
        """Rank r's lane beside its passes: (``GATHER`` or ``REDUCTION``, stage, start, end) in
        time order; empty where the panel has neither."""
        got = [(GATHER, s, a, b) for s, a, b in (self.gathers[r] if r < len(self.gathers) else ())]
        got += [(REDUCTION, s, a, b) for s, a, b in (self.reductions[r] if r < len(self.reductions) else ())]
        return sorted(got, key=lambda x: x[2])

    @property
    def has_lane(self) -> bool:
        """Whether some rank has a gather or a reduction to draw."""
        return any(self.gathers) or any(self.reductions)

    @property
    def bubble_rate(self) -> float:
        """The bubble rate of the bars (as ``zbsearch.simulator`` defines it: recompute passes
        count with the idle time)."""
        busiest = max((sum(b.end - b.start for b in row if b.action.op not in RECOMPUTES) for row in self.rows),
                      default=0.0)
        return bubble_rate(self.span, busiest)

    def title(self) -> str:
        """The panel's summary line: source, kind, p, m, span, bubble rate and peak memory."""
        chunks = f" ({self.chunks} chunks/rank)" if self.chunks > 1 else ""
        mem = f"   peak memory {self.peak_memory}" if self.peak_memory else ""
        it = f"   iteration {self.iteration:.4g} ms" if self.iteration is not None else ""
        mesh = f"   mesh {self.mesh}" if self.mesh else ""
        return (
            f"{self.source}: {self.kind}  p={self.num_ranks} m={self.num_microbatches}{chunks}   "
            f"span {self.span:.4g} ms{it}   bubble rate {self.bubble_rate:.4f}{mem}{mesh}"
        )

    def ops(self) -> list[tuple[str, int]]:
        """(op, chunk) keys of the bars that occur (``Bar.key``), in legend order."""
        seen = {b.key for row in self.rows for b in row}
        return sorted(seen, key=lambda oc: (key_order(oc[0]), oc[1]))


def colour(op: str, chunk: int) -> str:
    """Hex colour of an (op, chunk) box: chunk 0 the full hue, each later chunk lighter.

    Depends on the chunk alone so that stacked panels with different chunk counts agree."""
    frac = 0.6 * (1 - 0.4**chunk)
    r, g, b = (round(c + (255 - c) * frac) for c in _BASE_COLOURS[op])
    return f"#{r:02x}{g:02x}{b:02x}"


def text_colour(background: str) -> str:
    """Black or white, whichever reads better on ``background``."""
    r, g, b = (int(background[i : i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def op_char(op: str, chunk: int) -> str:
    """Text-mode letter: upper case for even chunks, lower case for odd ones (neighbours differ)."""
    c = _OP_CHARS[op]
    return c.lower() if chunk % 2 else c


def format_memory(value: float, unit: str) -> str:
    """A memory amount for a title: GiB for bytes, M_B for activations."""
    if unit == "activations":
        return f"{value:.3g} M_B"
    return f"{value / 2**30:.3g} GiB"


def nice_ticks(end: float, target: int) -> list[float]:
    """About ``target`` round tick positions (1, 2 or 5 times a power of ten) from 0 to ``end``."""
    if end <= 0 or target < 1:
        return [0.0]
    raw = end / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)
    return [i * step for i in range(int(end / step * (1 + REL_TOL)) + 1)]


def tick_label(t: float) -> str:
    """A tick position as text, without float noise."""
    return f"{round(t, 9):g}"  # round away float noise such as 0.6000000000000001


Item = tuple[str | Action | tuple[Action, Action], float, float]


def _chunk_of(rows: list[list[tuple[tuple[Action, ...], float, float]]]) -> tuple[list[dict[int, int]], int]:
    """Per rank, stage -> chunk index (order of the stage among those the rank runs)."""
    maps = []
    for row in rows:
        stages = sorted({a.stage for acts, _, _ in row for a in acts})
        maps.append({s: i for i, s in enumerate(stages)})
    return maps, max((len(m) for m in maps), default=1) or 1


def intervals_panel(
    kind: str,
    source: str,
    num_microbatches: int,
    rows: Sequence[Sequence[Item]],
    peak_memory: str | None = None,
    origin: float | None = None,
) -> Panel:
    """A panel from per-rank ``(action, start_ms, end_ms)`` lists, shifted so ``origin`` (default:
    the first start) is 0; an overlapped pair's action is its two actions (or the compact text
    ``"0F3+5B1"``)."""
    parsed = [sorted(((_actions(a), s, e) for a, s, e in row), key=lambda x: x[1]) for row in rows]
    if origin is None:
        origin = min((row[0][1] for row in parsed if row), default=0.0)
    chunk_maps, chunks = _chunk_of(parsed)
    bars = [
        [Bar(acts[0], chunk_maps[r][acts[0].stage], s - origin, e - origin, acts[1] if len(acts) > 1 else None)
         for acts, s, e in row] for r, row in enumerate(parsed)
    ]
    return Panel(kind, source, num_microbatches, chunks, bars, peak_memory)


def _actions(a: str | Action | tuple[Action, Action]) -> tuple[Action, ...]:
    if isinstance(a, Action):
        return (a,)
    if isinstance(a, tuple):
        return a
    return (parse_action(a),) if PAIR_SEP not in a else tuple(parse_row([a])[0])


def schedule_panel(schedule: Schedule) -> Panel:
    """The simulator's predicted timeline of ``schedule``, each overlapped pair one bar, with
    each rank's lane (its gathers and reductions) where the profile has them; time 0 is the
    first start of a pass or, where stages gather, of a step."""
    tl = timeline(schedule)
    rows: list[list[Item]] = []
    for r in range(tl.num_ranks):
        row, start, end, pairs = tl.actions[r], tl.start[r], tl.end[r], set(schedule.pairs(r))
        rows.append([((row[i], row[i + 1]) if i in pairs else row[i], start[i], end[i])
                     for i in range(len(row)) if i - 1 not in pairs])
    peak = format_memory(max(tl.peak_memory, default=0.0), schedule.profile.memory_unit)
    origin = min([*(row[0] for row in tl.start if row), *tl.begin], default=0.0)
    panel = intervals_panel(schedule.kind, "predicted", schedule.num_microbatches, rows, peak, origin)
    made = schedule.profile.made_for
    if made.world > made.pp:  # costs per rank of a wider mesh: say which
        panel = replace(panel, mesh=made.describe())
    if not tl.finish:
        return panel

    def shifted(lanes: list[list[tuple[int, float, float]]]) -> list[list[tuple[int, float, float]]]:
        return [[(s, a - origin, b - origin) for s, a, b in lane] for lane in lanes]

    return replace(panel, reductions=shifted(tl.reductions), gathers=shifted(tl.gathers), iteration=tl.period)
