"""Measured against predicted pass times: where a prediction goes wrong, pass type by pass type.

A span that misses its prediction says that something is off, not what. This compares each
kind of pass (F, B, W, fused BW) on each rank as the runtime timed it (``zbsearch.trace``) with
what the cost model gives the same actions, so a profile that misjudges, say, the fused
backward shows up as a BW ratio far from 1 while F, B and W agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Op
from .costs import CostModel
from .errors import ZbError
from .formats.schedule import Schedule
from .formats.trace import Trace

__all__ = ["PassTimes", "compare_pass_times"]


@dataclass(frozen=True)
class PassTimes:
    """One rank's passes of one type: how many were timed, mean measured and predicted ms."""

    rank: int
    op: Op
    count: int
    measured_ms: float
    predicted_ms: float

    @property
    def ratio(self) -> float:
        """Measured over predicted (inf where nothing was predicted)."""
        return self.measured_ms / self.predicted_ms if self.predicted_ms > 0 else float("inf")


def compare_pass_times(schedule: Schedule, traces: list[Trace]) -> list[PassTimes]:
    """Per rank and pass type (in Op order), over every action of every trace (one per step).

    A trace must be of this schedule: same ranks, and only actions the schedule has there;
    anything else is a ZbError, since comparing other passes would mean nothing."""
    if not traces:
        raise ZbError("no trace to compare")
    cost = CostModel.from_profile(schedule.profile.compute_only(), schedule.stage_to_rank)  # spans time passes only
    # what the cost model gives each action of each rank (an F costs t_ff where its backward is fused)
    planned = [dict(zip(row, d)) for row, d in zip(schedule.rank_actions, cost.durations(schedule.rank_actions))]
    sums: dict[tuple[int, Op], list[float]] = {}
    for i, trace in enumerate(traces):
        if trace.zbsearch.num_ranks != schedule.num_ranks:
            raise ZbError(f"trace {i + 1} has {trace.zbsearch.num_ranks} ranks but the schedule has {schedule.num_ranks}")
        for ev in trace.traceEvents:
            a = ev.action
            if a not in planned[ev.pid]:
                raise ZbError(
                    f"trace {i + 1} is not of this schedule: rank {ev.pid} ran {a}, which the schedule does not have there"
                )
            acc = sums.setdefault((ev.pid, a.op), [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += ev.dur / 1e3
            acc[2] += planned[ev.pid][a]
    return [
        PassTimes(r, op, int(n), measured / n, predicted / n)
        for (r, op), (n, measured, predicted) in sorted(sums.items(), key=lambda kv: (kv[0][0], list(Op).index(kv[0][1])))
    ]
