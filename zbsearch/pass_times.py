"""Measured against predicted pass times: where a prediction goes wrong, pass type by pass type.

A span that misses its prediction says that something is off, not what. This compares each
kind of pass (F, B, W, fused BW) on each rank as the runtime timed it (``zbsearch.trace``) with
what the cost model gives the same actions, so a profile that misjudges, say, the fused
backward shows up as a BW ratio far from 1 while F, B and W agree.

An overlapped pair (``Schedule.overlapped``) runs its forward and its backward at once, so the
runtime times them as one block: it is compared as one, its own kind of row (``F+B`` or
``F+BW``), against what the cost model says the pair costs (``CostModel.pair_time``), and its
two passes count in no F, B or BW row.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, Op
from .costs import CostModel
from .errors import ZbError
from .formats.schedule import Schedule
from .formats.trace import Trace

__all__ = ["PassTimes", "compare_pass_times"]


@dataclass(frozen=True)
class PassTimes:
    """One rank's passes of one type: how many were timed, mean measured and predicted ms.
    ``pair``: overlapped pairs of a forward (``op``, F) and a backward of this type, each timed
    as one block."""

    rank: int
    op: Op
    count: int
    measured_ms: float
    predicted_ms: float
    pair: Op | None = None

    @property
    def kind(self) -> str:
        """``F``, ``B``, ...; ``F+B`` or ``F+BW`` for overlapped pairs."""
        return self.op.value if self.pair is None else f"{self.op.value}+{self.pair.value}"

    @property
    def ratio(self) -> float:
        """Measured over predicted (inf where nothing was predicted)."""
        return self.measured_ms / self.predicted_ms if self.predicted_ms > 0 else float("inf")


def compare_pass_times(schedule: Schedule, traces: list[Trace]) -> list[PassTimes]:
    """Per rank and pass type (in Op order, then the pairs), over every action of every trace
    (one per step).

    A trace must be of this schedule: same ranks, and only actions the schedule has there;
    anything else is a ZbError, since comparing other passes would mean nothing."""
    if not traces:
        raise ZbError("no trace to compare")
    cost = CostModel.from_profile(schedule.profile.compute_only(), schedule.stage_to_rank)  # spans time passes only
    # what the cost model gives each action of each rank (an F costs t_ff where its backward is fused)
    planned = [dict(zip(row, d)) for row, d in zip(schedule.rank_actions, cost.durations(schedule.rank_actions))]
    # per rank, each overlapped pair's forward -> its backward, and what the pair costs
    pairs: list[dict[Action, Action]] = [
        {row[i]: row[i + 1] for i in schedule.pairs(r)} for r, row in enumerate(schedule.rank_actions)]
    in_pair = [set(p.values()) for p in pairs]
    sums: dict[tuple[int, Op, Op | None], list[float]] = {}
    for i, trace in enumerate(traces):
        if trace.zbsearch.num_ranks != schedule.num_ranks:
            raise ZbError(f"trace {i + 1} has {trace.zbsearch.num_ranks} ranks but the schedule has {schedule.num_ranks}")
        ends = {(ev.pid, ev.action): ev.ts + ev.dur for ev in trace.traceEvents}
        for ev in trace.traceEvents:
            a, r = ev.action, ev.pid
            if a not in planned[r]:
                raise ZbError(
                    f"trace {i + 1} is not of this schedule: rank {r} ran {a}, which the schedule does not have there"
                )
            if a in in_pair[r]:
                continue  # timed with its pair's forward
            b = pairs[r].get(a)
            key: tuple[int, Op, Op | None]
            if b is None:
                key, measured, predicted = (r, a.op, None), ev.dur, planned[r][a]
            else:
                if (r, b) not in ends:
                    raise ZbError(f"trace {i + 1} is not of this schedule: rank {r} ran {a} without {b}, its pair")
                key = (r, a.op, b.op)
                measured = max(ends[(r, a)], ends[(r, b)]) - ev.ts  # the pair's block: both end before it does
                predicted = cost.pair_time(a, b, planned[r][a], planned[r][b])
            acc = sums.setdefault(key, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += measured / 1e3
            acc[2] += predicted
    order = list(Op)
    return [
        PassTimes(r, op, int(n), measured / n, predicted / n, pair)
        for (r, op, pair), (n, measured, predicted) in sorted(
            sums.items(), key=lambda kv: (kv[0][0], kv[0][2] is not None, order.index(kv[0][1]),
                                          -1 if kv[0][2] is None else order.index(kv[0][2])))
    ]
