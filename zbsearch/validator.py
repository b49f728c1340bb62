"""Validator: is a schedule executable, complete and within its memory limit?

Checks, in this order, and reports the first failure with the action that causes it:
placement (each action on the rank that owns its stage), completeness (each F, B and W of
each stage and microbatch exactly once, BW counting as B and W), same-rank order (no pass
before a pass of its own rank it depends on), deadlock (a cycle through the ranks' orders and
the cross-rank dependencies, found with networkx and printed as the chain of waits), and
memory (the running activation total on each rank never exceeds the rank's limit).
"""

from __future__ import annotations

import networkx as nx

from .actions import Action, Op
from .costs import CostModel
from .errors import ZbError
from .graph import action_index, action_predecessors
from .profile import Profile
from .schedule import Schedule

__all__ = ["InvalidSchedule", "find_problem", "validate"]

_MEM_RTOL = 1e-9


class InvalidSchedule(ZbError):
    """The schedule cannot run as written (the message names the first offending action)."""


def validate(schedule: Schedule, profile: Profile | None = None, memory_limit: list[float] | None = None) -> None:
    problem = find_problem(schedule, profile, memory_limit)
    if problem:
        raise InvalidSchedule(problem)


def find_problem(schedule: Schedule, profile: Profile | None = None, memory_limit: list[float] | None = None) -> str | None:
    """The first problem found, as one line, or None if the schedule is valid."""
    S, m = schedule.num_stages, schedule.num_microbatches
    rows = schedule.rank_actions
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            owner = schedule.stage_to_rank[a.stage]
            if owner != r:
                return f"{a} is on rank {r} (position {i}) but stage {a.stage} lives on rank {owner}"

    seen: dict[tuple[int, Op, int], tuple[int, int]] = {}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for op in a.parts():
                key = (a.stage, op, a.mb)
                if key in seen:
                    pr, pi = seen[key]
                    what = f"{a.stage}{op.value}{a.mb}"
                    return f"{what} is done twice: {rows[pr][pi]} at rank {pr} position {pi} and {a} at rank {r} position {i}"
                seen[key] = (r, i)
    for s in range(S):
        for j in range(m):
            for op in (Op.F, Op.B, Op.W):
                if (s, op, j) not in seen:
                    return f"{s}{op.value}{j} is missing (rank {schedule.stage_to_rank[s]} never runs it)"

    index = action_index(rows)
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for dep in action_predecessors(a, S):
                dr, di = index[dep]
                if dr == r and di > i:
                    return (
                        f"rank {r}: {a} at position {i} comes before {rows[dr][di]} at position {di}, "
                        f"which it depends on"
                    )

    cycle = _deadlock_cycle(rows, index, S)
    if cycle:
        return "deadlock: " + ", which waits for ".join(f"{a} (rank {r})" for r, a in cycle)

    limit = memory_limit if memory_limit is not None else schedule.memory_limit
    if limit is not None:
        if len(limit) != schedule.num_ranks:
            return f"memory limit has {len(limit)} values for {schedule.num_ranks} ranks"
        cost = CostModel.from_profile(profile or schedule.profile, schedule.stage_to_rank)
        for r, row in enumerate(rows):
            cur = 0.0
            for i, a in enumerate(row):
                cur += cost.memory(a.stage, a.op)
                if cur > limit[r] * (1 + _MEM_RTOL) + 1e-12:
                    return (
                        f"rank {r}: memory reaches {cur:.6g} after {a} (position {i}), "
                        f"over its limit {limit[r]:.6g}"
                    )
    return None


def _deadlock_cycle(rows: list[list[Action]], index, S: int) -> list[tuple[int, Action]] | None:
    """A cycle of waits, each node waiting for the next, or None."""
    g = nx.DiGraph()
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if i:
                g.add_edge((r, i), (r, i - 1))  # waits for its predecessor on the rank
            for dep in action_predecessors(a, S):
                g.add_edge((r, i), index[dep])
    try:
        cyc = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return None
    # Report the cross-rank waits only: same-rank steps are implied by the order.
    nodes = [u for u, _ in cyc]
    keep = [n for k, n in enumerate(nodes) if nodes[(k + 1) % len(nodes)][0] != n[0]] or nodes
    return [(r, rows[r][i]) for r, i in keep]


