"""Simulator: the timeline a schedule produces under a cost model.

Each rank executes its list strictly in order; an action starts as soon as the previous
action on its rank has finished and every pass it depends on has finished (plus the
communication delay when that pass ran on another rank). Communication is modelled as a
latency that does not occupy either rank, which is what asynchronous P2P achieves when
transfers overlap compute. Memory on a rank changes only through its own actions, so the
memory curve depends on the order alone, not on timing.

Bubble rate generalises the paper's (span - m(T_F+T_B+T_W)) / span to unequal stages as
(T - max_r busy_r) / T with T = max_r span_r: the time the slowest rank's period exceeds the
compute of the busiest rank, the part of the iteration a schedule can remove. It equals the
paper's formula when stages are uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Action
from .costs import CostModel
from .dependencies import action_index, action_predecessors, edge_delay
from .errors import ZbError

__all__ = ["Timeline", "Deadlock", "simulate", "bubble_rate"]


class Deadlock(ZbError):
    """No rank can proceed. ``waits``: (rank, its next action, the action it waits for, that rank)."""

    def __init__(self, waits: list[tuple[int, Action, Action, int]]):
        self.waits = waits
        super().__init__("deadlock: " + "; ".join(f"rank {r} waits at {a} for {b} (rank {q})" for r, a, b, q in waits))


@dataclass(frozen=True)
class Timeline:
    actions: list[list[Action]]
    start: list[list[float]]
    end: list[list[float]]
    memory: list[list[float]]  # memory on the rank after each action
    busy: list[float]

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def span(self) -> list[float]:
        return [(e[-1] - s[0]) if s else 0.0 for s, e in zip(self.start, self.end)]

    @property
    def makespan(self) -> float:
        ends = [e[-1] for e in self.end if e]
        starts = [s[0] for s in self.start if s]
        return max(ends) - min(starts) if ends else 0.0

    @property
    def peak_memory(self) -> list[float]:
        return [max([0.0, *m]) for m in self.memory]

    @property
    def bubble_rate(self) -> float:
        return bubble_rate(max(self.span), max(self.busy))

    def bubble_rate_makespan(self) -> float:
        return bubble_rate(self.makespan, max(self.busy))


def bubble_rate(period: float, busiest: float) -> float:
    return (period - busiest) / period if period > 0 else 0.0


def simulate(rank_actions: list[list[Action]], cost: CostModel) -> Timeline:
    """Timeline of ``rank_actions``; raises ZbError on a missing dependency or a deadlock."""
    S = cost.num_stages
    index = action_index(rank_actions)
    R = len(rank_actions)
    # Resolve each action's dependencies once: (rank, position, delay).
    deps: list[list[list[tuple[int, int, float]]]] = []
    for r, row in enumerate(rank_actions):
        row_deps = []
        for a in row:
            resolved = []
            for st, op, mb in action_predecessors(a, S):
                where = index.get((st, op, mb))
                if where is None:
                    raise ZbError(f"{a} on rank {r} depends on {st}{op.value}{mb}, which no rank executes")
                resolved.append((where[0], where[1], edge_delay(cost, st, a.stage)))
            row_deps.append(resolved)
        deps.append(row_deps)

    start = [[0.0] * len(row) for row in rank_actions]
    end = [[0.0] * len(row) for row in rank_actions]
    done = [0] * R  # number of actions finished per rank
    free = [0.0] * R
    remaining = sum(len(row) for row in rank_actions)
    while remaining:
        progressed = False
        for r in range(R):
            row = rank_actions[r]
            while done[r] < len(row):
                i = done[r]
                t = free[r]
                ready = True
                for dr, di, delay in deps[r][i]:
                    if di >= done[dr]:
                        ready = False
                        break
                    t = max(t, end[dr][di] + delay)
                if not ready:
                    break
                a = row[i]
                start[r][i] = t
                free[r] = end[r][i] = t + cost.time(a.stage, a.op)
                done[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise Deadlock(_waits(rank_actions, done, deps))

    memory = []
    for row in rank_actions:
        cur, trace = 0.0, []
        for a in row:
            cur += cost.memory(a.stage, a.op)
            trace.append(cur)
        memory.append(trace)
    busy = [sum(cost.time(a.stage, a.op) for a in row) for row in rank_actions]
    return Timeline(rank_actions, start, end, memory, busy)


def _waits(rank_actions, done, deps) -> list[tuple[int, Action, Action, int]]:
    waits = []
    for r, row in enumerate(rank_actions):
        if done[r] < len(row):
            blocker = next(((dr, di) for dr, di, _ in deps[r][done[r]] if di >= done[dr]), None)
            if blocker is not None:
                dr, di = blocker
                waits.append((r, row[done[r]], rank_actions[dr][di], dr))
    return waits
