"""Compute slowed by a running reduction or gather: the simulator against an event-by-event
reference, the factor-1 identity, bounds and the solver's verdict with the slowdown."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zbsearch as zb
from tests.helpers.reference import needs, positions, random_cost, random_order, reference_duration
from zbsearch.actions import Op
from zbsearch.bounds import memory_iteration_lower_bound
from zbsearch.reductions import slowed_end, with_reductions
from zbsearch.simulator import simulate


def event_reference(rows, cost):
    """The timeline by advancing a clock from event to event (a pass ends, a lane run starts or
    ends, a message arrives): each rank's pass progresses at 1/factor of its speed while the
    rank's lane runs a stage whose factor is above 1. The lane runs the rank's gathers first, in
    stage order from time 0, then each stage's reduction once its last W or BW has ended, one
    at a time in that order. (start, end, finish) per rank."""
    S, R = cost.num_stages, len(rows)
    where = positions(rows)
    factor = cost.slowdown or (1.0,) * S
    t_gather = cost.t_gather or (0.0,) * S
    closing = []
    for row in rows:
        last = {}
        for i, a in enumerate(row):
            if a.op in (Op.W, Op.BW):
                last[a.stage] = i
        closing.append({i: s for s, i in last.items()})
    firsts = [{a.stage: next(i for i, b in enumerate(row) if b.stage == a.stage) for a in row} for row in rows]
    queue = [[("gather", s, t_gather[s]) for s in sorted({a.stage for a in row})] for row in rows]
    gathered: list[set[int]] = [set() for _ in rows]
    running_lane: list = [None] * R  # (kind, stage, end)
    lane_end = [0.0] * R
    start = [[None] * len(row) for row in rows]
    end = [[None] * len(row) for row in rows]
    nxt, work = [0] * R, [None] * R  # next position to start; (position, work left) of the running pass
    now = 0.0

    def ready_at(r):
        a = rows[r][nxt[r]]
        t = now
        for d in needs(a, S):
            q, i = where[d]
            if end[q][i] is None:
                return None
            t = max(t, end[q][i] + (cost.comm(d[0], a.stage) if d[0] != a.stage else 0.0))
        if firsts[r][a.stage] == nxt[r] and a.stage not in gathered[r]:
            return None
        return t

    def speed(r):
        run = running_lane[r]
        return 1.0 / factor[run[1]] if run is not None and run[2] > now else 1.0

    while True:
        moved = True
        while moved:  # everything that happens at ``now``
            moved = False
            for r in range(R):
                run = running_lane[r]
                if run is not None and run[2] <= now:
                    if run[0] == "gather":
                        gathered[r].add(run[1])
                    lane_end[r] = max(lane_end[r], run[2])
                    running_lane[r], moved = None, True
                if running_lane[r] is None and queue[r]:
                    kind, s, took = queue[r].pop(0)
                    running_lane[r], moved = (kind, s, now + took), True
                if work[r] is not None and work[r][1] <= 1e-12:
                    i = work[r][0]
                    end[r][i], work[r], moved = now, None, True
                    if i in closing[r]:
                        s = closing[r][i]
                        queue[r].append(("reduce", s, cost.t_reduce[s]))
                if work[r] is None and nxt[r] < len(rows[r]):
                    t = ready_at(r)
                    if t is not None and t <= now:
                        start[r][nxt[r]] = now
                        work[r] = (nxt[r], reference_duration(rows[r], rows[r][nxt[r]], cost))
                        nxt[r] += 1
                        moved = True
        events = []
        for r in range(R):
            if work[r] is not None:
                events.append(now + work[r][1] / speed(r))
            if running_lane[r] is not None:
                events.append(running_lane[r][2])
            if work[r] is None and nxt[r] < len(rows[r]):
                t = ready_at(r)
                if t is not None:
                    events.append(t)
        if not events:
            break
        later = min(events)
        for r in range(R):
            if work[r] is not None:
                i, left = work[r]
                done = (later - now) * speed(r)
                work[r] = (i, 0.0 if later == now + left / speed(r) else max(0.0, left - done))
        now = later
    assert all(n == len(row) for n, row in zip(nxt, rows)), "the reference stopped: a deadlock"
    finish = [max([*(e[-1:]), lane_end[r]]) + sum(cost.t_opt[s] for s in {a.stage for a in rows[r]}) if rows[r] else 0.0
              for r, e in enumerate(end)]
    return start, end, finish


def _slowed_case(seed: int, gathers: bool):
    rng = random.Random(seed)
    p = rng.choice([1, 2, 3, 4])
    cost = random_cost(rng, p, rng.choice([1, 2]), rng.choice(["looped", "v"]))
    S = cost.num_stages
    cost = replace(cost, t_reduce=tuple(rng.choice([0.0, rng.uniform(0.1, 5.0)]) for _ in range(S)),
                   t_opt=tuple(rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in range(S)),
                   slowdown=tuple(rng.choice([1.0, 1.5, rng.uniform(1.0, 4.0)]) for _ in range(S)),
                   t_gather=tuple(rng.choice([0.0, rng.uniform(0.1, 3.0)]) for _ in range(S)) if gathers else ())
    rows = random_order(rng, cost, rng.randint(1, 4), fuse=rng.random())
    return cost, rows


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_the_simulator_agrees_with_an_event_by_event_reference(seed, gathers):
    cost, rows = _slowed_case(seed, gathers)
    tl = simulate(rows, cost)
    start, end, finish = event_reference(rows, cost)
    for r in range(len(rows)):
        assert tl.start[r] == pytest.approx(start[r], rel=1e-9, abs=1e-9)
        assert tl.end[r] == pytest.approx(end[r], rel=1e-9, abs=1e-9)
    assert tl.finish == pytest.approx(finish, rel=1e-9, abs=1e-9)
    # every pass ends no earlier than at full speed, and so does the iteration
    fast = simulate(rows, cost.without_slowdown())
    for r in range(len(rows)):
        assert all(e >= f - 1e-9 for e, f in zip(tl.end[r], fast.end[r]))
    assert tl.busy == fast.busy
    # the iteration bound, which prices passes at full speed, stays below the slowed schedule
    m = sum(a.op is Op.F and a.stage == 0 for row in rows for a in row)
    assert memory_iteration_lower_bound(cost, m, None, quick=True) <= tl.period * (1 + 1e-9) + 1e-9


def test_a_factor_of_one_is_compute_at_its_own_speed():
    for seed in range(30):
        cost, rows = _slowed_case(seed, seed % 2 == 0)
        ones = simulate(rows, replace(cost, slowdown=(1.0,) * cost.num_stages))
        plain = simulate(rows, cost.without_slowdown())
        assert (ones.start, ones.end, ones.finish, ones.reductions) == (plain.start, plain.end, plain.finish, plain.reductions)


def test_a_pass_is_slowed_for_the_part_it_overlaps_by_hand():
    runs = [(2.0, 4.0, 2.0), (6.0, 7.0, 3.0)]
    assert slowed_end(0.0, 1.0, runs) == 1.0  # ends before the lane runs
    assert slowed_end(0.0, 3.0, runs) == 4.0  # 2 at full speed, then 1 at half speed over 2-4
    assert slowed_end(3.0, 0.5, runs) == 4.0  # inside the run: 0.5 takes 1
    assert slowed_end(1.0, 4.5, runs) == pytest.approx(7.0 + 1 / 6)  # 1 + 1 + 2 by 6, 1/3 in the second run, 1/6 after
    assert slowed_end(8.0, 2.0, runs) == 10.0


def test_a_reduction_beside_the_drain_slows_the_passes_it_overlaps():
    # rank 0 holds the first and the last stage (a V): the last one's last W ends before the rank's stage-0 passes,
    # so its reduction runs beside them, and a factor 2 slows them while it runs
    base = zb.Profile(name="u", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.6, m_w=-0.4)] * 4)
    prof = with_reductions(base, 2, 1.0, [4e6] * 4)
    v = zb.build_classic("zb-v", prof, 4)
    cost = zb.CostModel.from_profile(prof, v.stage_to_rank)
    plain, slowed = simulate(v.rank_actions, cost), simulate(v.rank_actions, replace(cost, slowdown=(2.0,) * cost.num_stages))
    (s0, start0, end0), _ = plain.reductions[0]
    assert s0 == cost.num_stages - 1 and start0 < plain.end[0][-1]
    overlapped = [i for i, (a, b) in enumerate(zip(plain.start[0], plain.end[0])) if a < end0 and b > start0]
    assert overlapped and slowed.end[0][overlapped[-1]] > plain.end[0][overlapped[-1]]
    assert slowed.period > plain.period


def test_bounds_hold_and_the_solver_never_calls_a_slowed_schedule_optimal_above_its_bound():
    rng = random.Random(7)
    statuses, slowed = [], 0
    for k in range(6):
        stages = [zb.StageCost(t_f=rng.uniform(0.5, 2), t_b=rng.uniform(0.5, 2), t_w=rng.uniform(0.2, 1.5), m_f=1,
                               m_b=-0.6, m_w=-0.4, reduce_slowdown=rng.choice([1.0, 1.5, 3.0])) for _ in range(2)]
        prof = with_reductions(zb.Profile(name="g", memory_unit="activations", stages=stages), 2, 1.0,
                               [rng.uniform(0.5e6, 4e6) for _ in range(2)])
        res = zb.solve(prof, 2, None, chunks=1 + k % 2, time_limit=1.0)
        cost = zb.CostModel.from_profile(prof, res.schedule.stage_to_rank)
        tl = simulate(res.schedule.rank_actions, cost)
        info = res.schedule.solver
        assert info.value == pytest.approx(tl.period)
        assert memory_iteration_lower_bound(cost, 2, None) <= tl.period * (1 + 1e-9)
        if info.status == "optimal":
            assert tl.period <= info.lower_bound * (1 + 2e-6)
        statuses.append(info.status)
        slowed += tl.period > simulate(res.schedule.rank_actions, cost.without_slowdown()).period
    assert "optimal" in statuses and slowed  # both checks above are exercised
