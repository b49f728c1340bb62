"""Validator: is a schedule executable, complete and within its memory limit?

Checks, in this order, and reports the first failure with the action that causes it:
placement (each action on the rank that owns its stage), completeness (each F, B and W of
each stage and microbatch exactly once, BW counting as B and W), recomputation (at most one
recompute pass per stage and microbatch, one the profile offers on that stage, before that
microbatch's backward on the rank), overlapped pairs (neither pass of a pair depends on the
other, directly or through other passes: the pair starts when both inputs are there, so such a
pair could never start), same-rank order (no pass
before a pass of its own rank it depends on), deadlock (a cycle through the ranks' orders and
the cross-rank dependencies, found with networkx and printed as the chain of waits), and
memory (the running activation total on each rank never exceeds the rank's limit).
Deadlock is found by running the orders (the simulator stops when no rank can move) and then
following "rank r waits for rank q" edges with networkx until they close a cycle. Same-rank
order is looked at only then: an order that runs through has no such problem (the rank would
wait for itself), so a valid schedule costs one simulation and a few passes over its actions,
and none when the caller hands in the timeline it has already simulated.
"""

from __future__ import annotations

from .actions import RECOMPUTES, Action, Op, pair_text
from .costs import CostModel
from .dependencies import action_predecessor_types, must_precede, pass_positions, recompute_positions
from .errors import ZbError
from .formats.profile import Profile
from .formats.schedule import Schedule
from .limits import fits
from .simulator import Deadlock, Timeline, simulate

__all__ = ["InvalidSchedule", "find_problem", "validate"]


class InvalidSchedule(ZbError):
    """The schedule cannot run as written (the message names the first offending action)."""


def validate(schedule: Schedule, profile: Profile | None = None, memory_limit: list[float] | None = None,
             timeline: Timeline | None = None) -> None:
    """Check that ``schedule`` can run as written; return quietly if it can.

    Args:
        schedule: the schedule to check.
        profile: the costs to check it under (default: the schedule's own profile); its
            memory deltas decide the memory check.
        memory_limit: per-rank limit (default: the schedule's own ``memory_limit``; none if
            that is None).
        timeline: the schedule's timeline on that profile, if already simulated.

    Raises:
        InvalidSchedule: the first problem found, as one line naming the action that causes it.
    """
    problem = find_problem(schedule, profile, memory_limit, timeline)
    if problem:
        raise InvalidSchedule(problem)


def find_problem(schedule: Schedule, profile: Profile | None = None, memory_limit: list[float] | None = None,
                 timeline: Timeline | None = None) -> str | None:
    """The first problem found, as one line, or None if the schedule is valid.

    ``timeline``: the schedule's timeline on that profile, if the caller has simulated it
    already (the solver has): it replaces the simulation here."""
    S, m = schedule.num_stages, schedule.num_microbatches
    rows = schedule.rank_actions
    for r, row in enumerate(rows):
        if any(schedule.stage_to_rank[s] != r for s in {a.stage for a in row}):
            for i, a in enumerate(row):
                owner = schedule.stage_to_rank[a.stage]
                if owner != r:
                    return f"{a} is on rank {r} (position {i}) but stage {a.stage} lives on rank {owner}"

    where = pass_positions(rows, S, m)  # the first action performing each pass
    BW = Op.BW
    performed = sum(len(row) + sum(1 for a in row if a.op is BW) - sum(1 for a in row if a.op in RECOMPUTES) for row in rows)
    if performed != sum(len(slot) - slot.count(None) for by_stage in where.values() for slot in by_stage):
        for r, row in enumerate(rows):  # some pass is performed twice: name the first repeat
            for i, a in enumerate(row):
                if a.op in RECOMPUTES:
                    continue
                for op in a.parts():
                    pr, pi = where[op][a.stage][a.mb]  # type: ignore[misc]  # the first performer
                    if (pr, pi) != (r, i):
                        what = f"{a.stage}{op.value}{a.mb}"
                        return f"{what} is done twice: {rows[pr][pi]} at rank {pr} position {pi} and {a} at rank {r} position {i}"
    if any(None in slot for by_stage in where.values() for slot in by_stage):
        for s in range(S):
            for j in range(m):
                for op in (Op.F, Op.B, Op.W):
                    if where[op][s][j] is None:
                        return f"{s}{op.value}{j} is missing (rank {schedule.stage_to_rank[s]} never runs it)"

    cost = None
    if any(a.op in RECOMPUTES for row in rows for a in row):
        cost = CostModel.from_profile(profile or schedule.profile, schedule.stage_to_rank)
        problem = _recompute_problem(rows, where, cost)
        if problem:
            return problem
    if schedule.overlapped is not None:
        problem = _pair_problem(rows, schedule.overlapped, S)
        if problem:
            return problem
    if timeline is None:
        cost = cost or CostModel.from_profile(profile or schedule.profile, schedule.stage_to_rank)
        try:
            timeline = simulate(rows, cost, schedule.overlapped)
        except Deadlock as dead:  # a pass before one of its own rank it needs, or a cycle across ranks
            return _order_problem(rows, where, S) or "deadlock: " + _wait_cycle(dead.waits)
    else:
        assert timeline.actions == rows, "the timeline given is of another schedule"

    limit = memory_limit if memory_limit is not None else schedule.memory_limit
    if limit is not None:
        if len(limit) != schedule.num_ranks:
            return f"memory limit has {len(limit)} values for {schedule.num_ranks} ranks"
        for r, row in enumerate(rows):
            if fits(max(timeline.memory[r], default=0.0), limit[r]):
                continue
            for i, (a, cur) in enumerate(zip(row, timeline.memory[r])):
                if not fits(cur, limit[r]):
                    return (
                        f"rank {r}: memory reaches {cur:.6g} after {a} (position {i}), "
                        f"over its limit {limit[r]:.6g}"
                    )
    return None


def _recompute_problem(rows: list[list[Action]], where, cost: CostModel) -> str | None:
    """The first recompute pass that repeats one, that the profile does not offer, or that
    comes after the backward it rebuilds activations for."""
    for (s, j), places in recompute_positions(rows).items():
        r, i = places[0]
        a = rows[r][i]
        if len(places) > 1:
            r2, i2 = places[1]
            return f"{s}F{j} is recomputed twice: {a} at rank {r} position {i} and {rows[r2][i2]} at rank {r2} position {i2}"
        if cost.offer(s, a.op) is None:
            what = "full recomputation (t_r, m_fc)" if a.op is Op.R else "selective recomputation (t_rs, m_fs)"
            return f"{a} on rank {r}: the profile offers no {what} on stage {s}"
        br, bi = where[Op.B][s][j]  # complete: the backward exists
        if br == r and bi < i:
            return (f"rank {r}: {a} at position {i} comes after {rows[br][bi]} at position {bi}, "
                    f"whose activations it rebuilds")
    return None


def _pair_problem(rows: list[list[Action]], overlapped: list[list[int]], num_stages: int) -> str | None:
    """The first overlapped pair whose passes depend on each other (its backward needs its
    forward, directly or through other passes): the pair would wait for itself."""
    for r, (row, pairs) in enumerate(zip(rows, overlapped)):
        for i in pairs:
            f, b = row[i], row[i + 1]
            parts = b.parts()
            if f.mb == b.mb and any(must_precede((f.stage, Op.F), (b.stage, op), num_stages) for op in parts):
                return (f"rank {r}: the overlapped pair {pair_text(f, b)} at position {i} pairs {b} with {f}, which it "
                        f"depends on: a pair's passes must not depend on each other")
    return None


def _order_problem(rows: list[list[Action]], where, num_stages: int) -> str | None:
    """The first action that comes before a pass of its own rank it depends on (a schedule that
    runs through has none: its rank would wait for itself)."""
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for ds, dop in action_predecessor_types(a.stage, a.op, num_stages):
                dr, di = where[dop][ds][a.mb]  # complete: every pass is performed
                if dr == r and di > i:
                    return (
                        f"rank {r}: {a} at position {i} comes before {rows[dr][di]} at position {di}, "
                        f"which it depends on"
                    )
    return None


def _wait_cycle(waits: list[tuple[int, Action, Action, int]]) -> str:
    """The ranks' waits that form a cycle, as 'rank r waits at X for Y (rank q)' steps."""
    import networkx as nx  # here: it takes a while to import, and only a failing schedule needs it

    by_rank = {r: (a, b, q) for r, a, b, q in waits}
    g = nx.DiGraph((r, q) for r, (_, _, q) in by_rank.items())
    try:
        cycle = [u for u, _ in nx.find_cycle(g)]
    except nx.NetworkXNoCycle:  # every stuck rank waits on a stuck rank, so this cannot happen
        cycle = list(by_rank)
    return "; ".join(f"rank {r} waits at {by_rank[r][0]} for {by_rank[r][1]} (rank {by_rank[r][2]})" for r in cycle)
