"""Measured against predicted data-parallel lane: per rank and stage, each parameter gather and
gradient reduction, and where each rank's step ends.

The runtime's trace records each rank's reductions (``Trace.zbsearch.reductions``: all-reduces,
or reduce-scatters where the stages are sharded) and its sharded stages' parameter gathers
(``Trace.zbsearch.gathers``) on the passes' clock; the simulator's lane (``zbsearch.reductions``)
predicts the same figures from the profile's ``t_reduce`` and ``t_gather``:

* a reduction: how long after the stage's last backward it started, and how long it took. One
  that starts late says the runtime did not start it at the stage's last W; one that takes
  longer says the links are slower than priced, or that the reductions contend with something
  the profile did not see;
* a gather: how long from the step's start (when the runtime issues every gather of the rank)
  until it was complete, and how long before the stage's first pass it was. One that takes
  longer than predicted delays the rank's first pass;
* the lane's end: per rank, from the step's start (on the rank of the step's first pass: its
  first gather issued, else that pass) to the end of its last pass or reduction, and the
  step's, the latest of them. The optimizer step is left out: the runtime's step ends before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .actions import Op
from .errors import ZbError
from .formats.schedule import Schedule
from .formats.trace import Trace
from .prediction import timeline

__all__ = ["ReductionTimes", "compare_reductions", "GatherTimes", "compare_gathers", "LaneEnd", "compare_lane_ends"]


@dataclass(frozen=True)
class ReductionTimes:
    """One rank's reduction of one stage: mean over the traces (ms); predictions None where
    the profile has no reduction times."""

    rank: int
    stage: int
    count: int
    measured_ms: float
    measured_delay_ms: float  # from the stage's last W or BW to the reduction's start
    predicted_ms: float | None
    predicted_delay_ms: float | None


def _entries(schedule: Schedule, traces: list[Trace], lane: str) -> Iterator[tuple[int, int, list, tuple]]:
    """(trace index, rank, the rank's events, entry) for each entry of each trace's ``lane``
    (``reductions`` or ``gathers``; traces without it skipped)."""
    for i, trace in enumerate(traces):
        lanes = getattr(trace.zbsearch, lane)
        if lanes is None:
            continue
        if len(lanes) != schedule.num_ranks:
            raise ZbError(f"trace {i + 1} has {lane} of {len(lanes)} ranks but the schedule has {schedule.num_ranks}")
        rows = trace.rank_events()
        for r, entries in enumerate(lanes):
            for entry in entries:
                yield i, r, rows[r], entry


def _last_backward_end(events, stage: int) -> float | None:
    ends = [ev.ts + ev.dur for ev in events if ev.args.stage == stage and ev.args.op in (Op.W, Op.BW)]
    return max(ends) if ends else None


def compare_reductions(schedule: Schedule, traces: list[Trace]) -> list[ReductionTimes]:
    """Per rank and stage, over the traces that recorded reductions (in rank, then start order);
    empty where none did."""
    measured: dict[tuple[int, int], list[tuple[float, float]]] = {}
    order: dict[tuple[int, int], float] = {}
    for i, r, events, (s, start, end) in _entries(schedule, traces, "reductions"):
        ready = _last_backward_end(events, s)
        if ready is None:
            raise ZbError(f"trace {i + 1}: rank {r} reduced stage {s}, whose backward it never ran")
        measured.setdefault((r, s), []).append(((end - start) / 1e3, (start - ready) / 1e3))
        order.setdefault((r, s), start)
    if not measured:
        return []
    predicted: dict[tuple[int, int], tuple[float, float]] = {}
    if schedule.profile.has_reductions:
        tl = timeline(schedule)
        for r, lane in enumerate(tl.reductions):
            ends = {a.stage: e for a, e in zip(tl.actions[r], tl.end[r]) if a.op in (Op.W, Op.BW)}
            for s, start, end in lane:
                predicted[(r, s)] = (end - start, start - ends[s])
    out = []
    for (r, s), xs in sorted(measured.items(), key=lambda kv: (kv[0][0], order[kv[0]])):
        p = predicted.get((r, s))
        out.append(ReductionTimes(r, s, len(xs), sum(d for d, _ in xs) / len(xs), sum(w for _, w in xs) / len(xs),
                                  None if p is None else p[0], None if p is None else p[1]))
    return out


@dataclass(frozen=True)
class GatherTimes:
    """One rank's gather of one stage's parameters: mean over the traces (ms); predictions None
    where the profile has no gather times."""

    rank: int
    stage: int
    count: int
    bytes: float
    measured_ms: float  # from the step's start (issued) until complete
    measured_slack_ms: float  # from its end to the stage's first pass
    predicted_ms: float | None
    predicted_slack_ms: float | None


def _first_start(events, stage: int) -> float | None:
    return min((ev.ts for ev in events if ev.args.stage == stage), default=None)


def compare_gathers(schedule: Schedule, traces: list[Trace]) -> list[GatherTimes]:
    """Per rank and stage, over the traces that recorded gathers (in rank, then issue order);
    empty where none did."""
    measured: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    order: dict[tuple[int, int], float] = {}
    for i, r, events, (s, start, end, nbytes) in _entries(schedule, traces, "gathers"):
        first = _first_start(events, s)
        if first is None:
            raise ZbError(f"trace {i + 1}: rank {r} gathered stage {s}, whose passes it never ran")
        measured.setdefault((r, s), []).append(((end - start) / 1e3, (first - end) / 1e3, nbytes))
        order.setdefault((r, s), start)
    if not measured:
        return []
    predicted: dict[tuple[int, int], tuple[float, float]] = {}
    if any(st.t_gather for st in schedule.profile.stages):
        tl = timeline(schedule)
        for r, runs in enumerate(tl.gathers):
            begin = tl.begin[r] if r < len(tl.begin) else 0.0
            firsts: dict[int, float] = {}
            for a, t in zip(tl.actions[r], tl.start[r]):
                firsts.setdefault(a.stage, t)
            for s, _, end in runs:
                predicted[(r, s)] = (end - begin, firsts[s] - end)
    out = []
    for (r, s), xs in sorted(measured.items(), key=lambda kv: (kv[0][0], order[kv[0]])):
        p = predicted.get((r, s))
        n = len(xs)
        out.append(GatherTimes(r, s, n, sum(b for _, _, b in xs) / n, sum(d for d, _, _ in xs) / n,
                               sum(w for _, w, _ in xs) / n, None if p is None else p[0], None if p is None else p[1]))
    return out


@dataclass(frozen=True)
class LaneEnd:
    """Where one rank's step ends (``rank`` None: the step's, the latest rank's), from the step's
    start: mean over the traces (ms), and as predicted."""

    rank: int | None
    count: int
    measured_ms: float
    predicted_ms: float


def compare_lane_ends(schedule: Schedule, traces: list[Trace]) -> list[LaneEnd]:
    """Per rank, then the step: from the step's start to the end of the rank's last pass or
    reduction, measured (mean over ``traces``) and predicted, optimizer steps left out (module
    docstring).

    The step starts on the rank that runs its first pass: with no barrier between steps, a rank
    that finished the previous step early starts this one early and only waits longer for its
    input, so the step's work starts with the first pass's rank. Where a trace records gathers,
    at that rank's first gather issued (and in the prediction, at that rank's step start),
    else at the first pass."""
    if not traces:
        return []
    tl = timeline(schedule)
    lanes = tl.reductions or [[] for _ in tl.end]
    last = [max([*e[-1:], *(b for _, _, b in lane)], default=0.0) for e, lane in zip(tl.end, lanes)]
    first = min((r for r in range(tl.num_ranks) if tl.start[r]), key=lambda r: tl.start[r][0], default=0)
    first_pass = tl.start[first][0] if tl.start[first] else 0.0
    from_gather = tl.begin[first] if tl.gathers and tl.begin else first_pass
    measured: list[list[float]] = []
    predicted: list[list[float]] = []
    for i, trace in enumerate(traces):
        rows = trace.rank_events()
        if len(rows) != schedule.num_ranks:
            raise ZbError(f"trace {i + 1} has {len(rows)} ranks but the schedule has {schedule.num_ranks}")
        done = trace.zbsearch.reductions or [[] for _ in rows]
        r0 = min((r for r in range(len(rows)) if rows[r]), key=lambda r: rows[r][0].ts, default=0)
        issued = [b for _, b, _, _ in (trace.zbsearch.gathers or [[] for _ in rows])[r0]]
        origin = min(issued) if issued else rows[r0][0].ts if rows[r0] else 0.0
        measured.append([(max([*(ev.ts + ev.dur for ev in row), *(e for _, _, e in lane)], default=origin) - origin) / 1e3
                         for row, lane in zip(rows, done)])
        start = from_gather if issued else first_pass
        predicted.append([x - start for x in last])
    n = len(traces)
    out = [LaneEnd(r, n, sum(e[r] for e in measured) / n, sum(p[r] for p in predicted) / n)
           for r in range(schedule.num_ranks)]
    return [*out, LaneEnd(None, n, sum(max(e) for e in measured) / n, sum(max(p) for p in predicted) / n)]
