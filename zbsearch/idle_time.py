"""Where a measured step's idle time goes: waits the model explains, and waits beyond it.

Pass times can all match the profile while the step still runs longer than predicted: the
time is then lost between passes. The simulator starts an action at the later of its rank's
previous end and, for each input, the end of the pass producing it plus the modelled link time
(0 between stages of one rank). The same rule applied to a runtime trace, with the *measured*
ends of the producers, splits every gap on a rank into

* dependency: until the inputs could have arrived by the model: a wait the simulator would
  have predicted too, given the measured pass times (a slow pass elsewhere, a bubble);
* link: what the rank waited after that for a message from another rank: the transfer took
  longer than the profile's link time (a late send, a receive posted late, a busy network
  thread);
* local: the rest of a gap before an action with no input from another rank (the runtime's own
  overhead between passes).

An overlapped pair (``Schedule.overlapped``) starts once the inputs of both its passes are in,
as the simulator starts it, so the gap before it is explained by the later of the two, and is a
link wait where either pass takes an input from another rank; its two passes end together, with
no gap between them.

A rank's first action counts from the step's first action on any rank. Clocks are aligned by
the runtime (``trace``), so a wait a little below 0 (the alignment's error) counts as none.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .actions import Op
from .costs import CostModel
from .dependencies import action_predecessor_types, edge_delay, remote_input
from .errors import ZbError
from .formats.schedule import Schedule
from .formats.trace import Trace

__all__ = ["RankIdleTime", "measure_idle_time"]

# A wait shorter than this (ms) is no late message: the trace's own resolution (µs, and float sums).
_RESOLUTION_MS = 1e-3


@dataclass(frozen=True)
class RankIdleTime:
    """One rank's idle time per step (mean over the traces), in ms, split by cause."""

    rank: int
    idle_ms: float
    dependency_ms: float
    link_ms: float
    local_ms: float
    late_messages: float  # receives per step that waited beyond the modelled link time
    link_excess_ms: tuple[float, float, float]  # quartiles of those waits beyond it (0s if none)


def measure_idle_time(schedule: Schedule, traces: list[Trace]) -> list[RankIdleTime]:
    """Per rank, the idle time of the measured steps split into dependency, link and local waits."""
    if not traces:
        raise ZbError("no trace to analyse")
    cost = CostModel.from_profile(schedule.profile.compute_only(), schedule.stage_to_rank)  # spans time passes only
    R, S = schedule.num_ranks, schedule.num_stages
    sums = [[0.0, 0.0, 0.0, 0.0, 0] for _ in range(R)]  # idle, dependency, link, local, late count
    excess: list[list[float]] = [[] for _ in range(R)]
    for i, trace in enumerate(traces):
        rows = trace.rank_events()
        if len(rows) != R or [[e.action for e in row] for row in rows] != schedule.rank_actions:
            raise ZbError(f"trace {i + 1} is not a step of this schedule (its ranks ran other actions)")
        done: dict[tuple[int, Op, int], float] = {}  # basic pass -> its measured end, ms
        for row in rows:
            for ev in row:
                for op in ev.action.parts():
                    done[(ev.action.stage, op, ev.action.mb)] = (ev.ts + ev.dur) / 1e3
        for r, row in enumerate(rows):
            prev = 0.0
            pairs = set(schedule.pairs(r))
            for k, ev in enumerate(row):
                start = ev.ts / 1e3
                if k - 1 in pairs:  # a pair's backward: it ran with the forward before it
                    prev = max(prev, start + ev.dur / 1e3)
                    continue
                held = [ev.action, row[k + 1].action] if k in pairs else [ev.action]
                gap = max(start - prev, 0.0)
                ready = max(
                    (done[(ds, dop, a.mb)] + edge_delay(cost, ds, a.stage)
                     for a in held for ds, dop in action_predecessor_types(a.stage, a.op, S)),
                    default=0.0,
                )
                explained = min(max(ready - prev, 0.0), gap)
                beyond = gap - explained
                acc = sums[r]
                acc[0] += gap
                acc[1] += explained
                if any(remote_input(a, schedule.stage_to_rank) is not None for a in held):
                    acc[2] += beyond
                    if beyond > _RESOLUTION_MS:
                        acc[4] += 1
                        excess[r].append(beyond)
                else:
                    acc[3] += beyond
                prev = start + ev.dur / 1e3
    n = len(traces)
    return [
        RankIdleTime(r, idle / n, dep / n, link / n, local / n, late / n, _quartiles(excess[r]))
        for r, (idle, dep, link, local, late) in enumerate(sums)
    ]


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return (0.0, 0.0, 0.0)
    if len(xs) == 1:
        return (xs[0],) * 3
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q1, q2, q3)
