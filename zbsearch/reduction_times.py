"""Measured against predicted data-parallel reductions: per rank and stage, how long after the
stage's last backward its reduction started, and how long it took.

The runtime's trace records each rank's reductions (``Trace.zbsearch.reductions``) on the
passes' clock; the simulator's reduction lane (``zbsearch.reductions``) predicts the same two
figures from the profile's ``t_reduce``. A reduction that starts late says the runtime did not
start it at the stage's last W; one that takes longer says the links are slower than priced,
or that the reductions contend with something the profile did not see.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Op
from .errors import ZbError
from .formats.schedule import Schedule
from .formats.trace import Trace
from .prediction import timeline

__all__ = ["ReductionTimes", "compare_reductions"]


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


def _last_backward_end(events, stage: int) -> float | None:
    ends = [ev.ts + ev.dur for ev in events if ev.args.stage == stage and ev.args.op in (Op.W, Op.BW)]
    return max(ends) if ends else None


def compare_reductions(schedule: Schedule, traces: list[Trace]) -> list[ReductionTimes]:
    """Per rank and stage, over the traces that recorded reductions (in rank, then start order);
    empty where none did."""
    measured: dict[tuple[int, int], list[tuple[float, float]]] = {}
    order: dict[tuple[int, int], float] = {}
    for i, trace in enumerate(traces):
        lanes = trace.zbsearch.reductions
        if lanes is None:
            continue
        if len(lanes) != schedule.num_ranks:
            raise ZbError(f"trace {i + 1} has reductions of {len(lanes)} ranks but the schedule has {schedule.num_ranks}")
        rows = trace.rank_events()
        for r, lane in enumerate(lanes):
            for s, start, end in lane:
                ready = _last_backward_end(rows[r], s)
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
