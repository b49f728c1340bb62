"""Lanes of different ranks on one link: runs at once slow each other (``reductions.share_rate``),
checked against an exact event-by-event reference written here from the rule's statement."""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import zbsearch as zb
from tests.helpers.reference import needs, positions, random_cost, random_order, reference_duration
from tests.test_overlap import moe_profile, pair_up
from zbsearch import CostModel
from zbsearch.actions import Op
from zbsearch.bounds import memory_iteration_lower_bound
from zbsearch.formats.profile import LaneSharing
from zbsearch.layout import placement
from zbsearch.reductions import lane_runs, share_rate, shared_lane_runs, with_reductions
from zbsearch.simulator import Deadlock, Timeline, simulate


def _reference(rows, cost, link, share):
    """Per rank: (start, end) of every action, its gathers and reductions (stage, start, end),
    the end of its iteration and its step's start, in exact arithmetic. At every moment each
    run under way on a link with k runs under way moves at 1 / (1 + share (k - 1)); each pass
    moves at 1 / the slowdown of its rank's run under way (1 without one); a lane runs its runs
    one at a time in the order they became ready, the gathers first (stage order, from 0); and,
    while its rank has a pass under way, a run moves at 1 / its stage's lane slowdown besides."""
    F = Fraction
    S, R = cost.num_stages, len(rows)
    where = positions(rows)
    slow = cost.slowdown or (1.0,) * S
    stretch = cost.stretch or (1.0,) * S
    last = [{} for _ in rows]  # per rank, stage -> position of its last W or BW
    first = [{} for _ in rows]  # per rank, stage -> position of its first pass
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            first[r].setdefault(a.stage, i)
            if a.op in (Op.W, Op.BW):
                last[r][a.stage] = i
    closing = [{i: s for s, i in d.items()} for d in last]
    queue = [[("g", s, F(cost.t_gather[s])) for s in sorted(first[r])] if cost.t_gather else [] for r in range(R)]
    lane_now = [None] * R  # (kind, stage, start, left)
    runs = [[] for _ in rows]
    start = [[None] * len(row) for row in rows]
    end = [[None] * len(row) for row in rows]
    nxt, job = [0] * R, [None] * R  # per rank, its pass under way: [position, left]
    gathered = [{} for _ in rows]
    t = F(0)
    while True:
        for r in range(R):  # the lanes take their next run
            while lane_now[r] is None and queue[r]:
                kind, s, work = queue[r].pop(0)
                if work == 0:
                    runs[r].append((kind, s, t, t))
                    if kind == "g":
                        gathered[r][s] = t
                else:
                    lane_now[r] = (kind, s, t, work)
        candidates = []
        for r, row in enumerate(rows):  # the passes that can start
            if job[r] is not None or nxt[r] == len(row):
                continue
            i, a = nxt[r], row[nxt[r]]
            at = end[r][i - 1] if i else F(0)
            if cost.t_gather and first[r][a.stage] == i:
                if a.stage not in gathered[r]:
                    continue
                at = max(at, gathered[r][a.stage])
            ok = True
            for d in needs(a, S):
                q, k = where[d]
                if end[q][k] is None:
                    ok = False
                    break
                at = max(at, end[q][k] + (F(cost.comm(d[0], a.stage)) if d[0] != a.stage else 0))
            if not ok:
                continue
            if at > t:
                candidates.append(at)
                continue
            assert at == t
            start[r][i] = t
            job[r] = [i, F(reference_duration(row, a, cost))]
        busy = {}
        for r in range(R):
            if lane_now[r] is not None:
                busy[link[r]] = busy.get(link[r], 0) + 1
        lane_rate = [F(1) / (1 + F(share) * (busy.get(link[r], 1) - 1)) for r in range(R)]
        pass_rate = [F(1) / F(slow[lane_now[r][1]]) if lane_now[r] is not None else F(1) for r in range(R)]
        for r in range(R):  # a rank computing slows its lane's run
            if job[r] is not None and lane_now[r] is not None:
                lane_rate[r] /= F(stretch[lane_now[r][1]])
        for r in range(R):
            if job[r] is not None:
                candidates.append(t + job[r][1] / pass_rate[r])
            if lane_now[r] is not None:
                candidates.append(t + lane_now[r][3] / lane_rate[r])
        if not candidates:
            break
        t2 = min(candidates)
        for r in range(R):
            if job[r] is not None:
                job[r][1] -= (t2 - t) * pass_rate[r]
            if lane_now[r] is not None:
                kind, s, a0, left = lane_now[r]
                lane_now[r] = (kind, s, a0, left - (t2 - t) * lane_rate[r])
        t = t2
        for r in range(R):
            if lane_now[r] is not None and lane_now[r][3] == 0:
                kind, s, a0, _ = lane_now[r]
                runs[r].append((kind, s, a0, t))
                if kind == "g":
                    gathered[r][s] = t
                lane_now[r] = None
        for r in range(R):
            if job[r] is not None and job[r][1] == 0:
                i = job[r][0]
                end[r][i], job[r], nxt[r] = t, None, i + 1
                if i in closing[r]:
                    s = closing[r][i]
                    queue[r].append(("r", s, F(cost.t_reduce[s])))
    assert all(n == len(row) for n, row in zip(nxt, rows))
    out = []
    for r in range(R):
        red = [(s, float(a), float(b)) for kind, s, a, b in runs[r] if kind == "r"]
        gat = [(s, float(a), float(b)) for kind, s, a, b in runs[r] if kind == "g" and b > a]
        finish = max([b for _, _, b in red] + [float(end[r][-1])]) + sum(cost.t_opt[s] for s in first[r])
        begin = min(float(start[r][first[r][s]] - gathered[r].get(s, 0)) for s in first[r]) if cost.t_gather else None
        out.append(([float(x) for x in start[r]], [float(x) for x in end[r]], gat, red, finish, begin))
    return out


def _random_lanes(rng: random.Random):
    p = rng.choice([2, 3, 4])
    cost = random_cost(rng, p, rng.choice([1, 2]), rng.choice(["looped", "v"]))
    S = cost.num_stages
    t_red = tuple(rng.choice([0.0, rng.uniform(0.5, 6.0)]) for _ in range(S))
    t_opt = tuple(rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in range(S))
    t_gather = tuple(rng.choice([0.0, rng.uniform(0.2, 3.0)]) for _ in range(S)) if rng.random() < 0.4 else ()
    slowdown = tuple(rng.choice([1.0, rng.uniform(1.0, 2.5)]) for _ in range(S)) if rng.random() < 0.6 else ()
    stretch = tuple(rng.choice([1.0, rng.uniform(1.0, 3.0)]) for _ in range(S)) if rng.random() < 0.6 else ()
    per = rng.choice([1, 2, p])
    link = tuple(r // per for r in range(p))
    share = rng.choice([0.0, 0.5, 1.0, rng.uniform(0.0, 2.0)])
    cost = replace(cost, t_reduce=t_red, t_opt=t_opt, t_gather=t_gather, slowdown=slowdown, stretch=stretch,
                   lane_link=link, lane_share=share)
    rows = random_order(rng, cost, rng.randint(1, 4), fuse=rng.random() * 0.5)
    return cost, rows


def _flat(runs):
    return [x for _, a, b in runs for x in (a, b)]


def _check_against_reference(tl, want):
    for r, (start, end, gat, red, finish, begin) in enumerate(want):
        assert tl.start[r] == pytest.approx(start, abs=1e-7)
        assert tl.end[r] == pytest.approx(end, abs=1e-7)
        assert [s for s, _, _ in tl.reductions[r]] == [s for s, _, _ in red]
        assert _flat(tl.reductions[r]) == pytest.approx(_flat(red), abs=1e-7)
        assert tl.finish[r] == pytest.approx(finish, abs=1e-7)
        if begin is not None:
            assert [s for s, _, _ in tl.gathers[r]] == [s for s, _, _ in gat]
            assert _flat(tl.gathers[r]) == pytest.approx(_flat(gat), abs=1e-7)
            assert tl.begin[r] == pytest.approx(begin, abs=1e-7)


@pytest.mark.parametrize("seed", range(60))
def test_the_simulator_times_shared_lanes_as_the_reference(seed):
    cost, rows = _random_lanes(random.Random(seed))
    tl = simulate(rows, cost)
    _check_against_reference(tl, _reference(rows, cost, cost.lane_link, cost.lane_share))
    # and with every lane alone on its link (the simulator's pass in dependency order)
    alone = replace(cost, lane_link=(), lane_share=0.0)
    _check_against_reference(simulate(rows, alone), _reference(rows, alone, range(cost.num_ranks), 0.0))


@settings(max_examples=40, deadline=None)
@given(hs.integers(0, 2**32 - 1), hs.floats(1.0, 4.0), hs.booleans())
def test_a_lane_slowed_beside_its_rank_s_passes_times_as_the_reference(seed, stretch, shared):
    # a V's reductions start while the rank still has passes to run: each moves at 1/stretch of
    # its speed while they do, at its own speed while the rank waits (exact reference above)
    rng = random.Random(seed)
    p = rng.choice([2, 3, 4])
    cost = random_cost(rng, p, 2, "v")
    S = cost.num_stages
    cost = replace(cost, t_reduce=tuple(rng.uniform(0.5, 8.0) for _ in range(S)), t_opt=(0.0,) * S,
                   t_gather=tuple(rng.uniform(0.2, 3.0) for _ in range(S)) if rng.random() < 0.3 else (),
                   slowdown=tuple(rng.choice([1.0, rng.uniform(1.0, 2.0)]) for _ in range(S)) if rng.random() < 0.5 else (),
                   stretch=tuple(rng.choice([1.0, stretch]) for _ in range(S)),
                   lane_link=(0,) * p if shared else (), lane_share=rng.uniform(0.0, 1.5) if shared else 0.0)
    rows = random_order(rng, cost, rng.randint(2, 4), fuse=0.3)
    tl = simulate(rows, cost)
    _check_against_reference(tl, _reference(rows, cost, cost.lane_link or range(p), cost.lane_share))
    full = simulate(rows, cost.without_slowdown())  # at full speed: no later anywhere
    assert all(a >= b - 1e-9 for x, y in zip(tl.end, full.end) for a, b in zip(x, y))
    assert all(a >= b - 1e-9 for a, b in zip(tl.finish, full.finish))


@pytest.mark.parametrize("seed", range(30))
def test_sharing_only_lengthens_and_the_bound_holds(seed):
    rng = random.Random(1000 + seed)
    cost, rows = _random_lanes(rng)
    tl, full = simulate(rows, cost), simulate(rows, cost.without_slowdown())
    for r in range(cost.num_ranks):
        assert all(a >= b - 1e-9 for a, b in zip(tl.end[r], full.end[r]))
        assert tl.finish[r] >= full.finish[r] - 1e-9
    m = max(a.mb for row in rows for a in row) + 1
    if all(sum(1 for row in rows for a in row if a.stage == s and a.op is Op.F) == m for s in range(cost.num_stages)):
        assert memory_iteration_lower_bound(cost, m, None, quick=True) <= tl.period + 1e-6


def test_no_sharing_is_each_lane_alone():
    rng = random.Random(7)
    for _ in range(200):
        lanes = [sorted((rng.uniform(0, 10), rng.choice([0.0, rng.uniform(0, 4)])) for _ in range(rng.randint(0, 5)))
                 for _ in range(rng.randint(1, 4))]
        alone = [lane_runs(x) for x in lanes]
        for link, share in (([0] * len(lanes), 0.0), (list(range(len(lanes))), 1.0)):
            got = shared_lane_runs(lanes, link, share)
            assert [[pytest.approx(x, abs=1e-9) for x in r] for r in got] == alone


def test_two_equal_runs_at_once_split_the_link():
    # share 1: two 4 ms runs from 0 each move at half speed and end at 8; a third lane on another
    # link is not slowed; share 0.5: each at 1 / 1.5, ending at 6; a run joining at 2 (share 1)
    # leaves the first 2 ms ahead: it ends at 2 + 2 * 2 = 6, the joiner alone from 6, at 6 + 2 = 8
    assert shared_lane_runs([[(0, 4)], [(0, 4)], [(0, 4)]], [0, 0, 1], 1.0) == [[(0, 8)], [(0, 8)], [(0, 4)]]
    assert shared_lane_runs([[(0, 4)], [(0, 4)]], [0, 0], 0.5) == [[(0, pytest.approx(6))], [(0, pytest.approx(6))]]
    assert shared_lane_runs([[(0, 4)], [(2, 4)]], [0, 0], 1.0) == [[(0, 6)], [(2, 8)]]
    assert share_rate(1, 3.0) == 1.0 and share_rate(3, 1.0) == pytest.approx(1 / 3)


def test_a_profile_s_sharing_reaches_the_costs_and_old_files_mean_none(tmp_path):
    prof = with_reductions(zb.resolve_profile("1.5b-m24"), 4, 50.0, [1e9] * 8)
    s = zb.build_classic("1f1b", prof, 24)
    plain = zb.CostModel.from_profile(prof, s.stage_to_rank)
    assert plain.lane_share == 0 and not plain.shares_lanes  # no section: no sharing
    dp = prof.data_parallel.model_copy(update={"sharing": LaneSharing(share=0.8, ranks_per_link=4)})
    shared = prof.model_copy(update={"data_parallel": dp})
    path = tmp_path / "p.json"
    zb.save_profile(shared, path)
    back = zb.load_profile(path)
    cost = zb.CostModel.from_profile(back, s.stage_to_rank)
    assert cost.lane_link == (0, 0, 0, 0, 1, 1, 1, 1) and cost.lane_share == 0.8 and cost.shares_lanes
    # 1F1B on 8 ranks: every reduction starts at once at the end, four to a link
    tl, alone = simulate(s.rank_actions, cost), simulate(s.rank_actions, plain)
    assert tl.period > alone.period
    assert max(tl.finish) <= max(alone.finish) + 3 * 0.8 * max(cost.t_reduce) + 1e-6


def _both_engines(rows, cost, pairs, monkeypatch):
    """``simulate`` by its pass in dependency order, and by its event-by-event engine with every
    lane on one link at share 0 (each at full speed): the Timeline, or the Deadlock, of each."""
    def run():
        try:
            return simulate(rows, cost, pairs)
        except Deadlock as e:
            return e

    alone = run()
    with monkeypatch.context() as m:
        m.setattr(CostModel, "shares_lanes", property(lambda self: True))
        cost = replace(cost, lane_link=(0,) * cost.num_ranks, lane_share=0.0)
        shared = run()
    return alone, shared


@pytest.mark.parametrize("seed", range(100))
def test_both_engines_time_alike_without_sharing(seed, monkeypatch):
    # gathers, reductions, slowdowns and overlapped pairs (some that deadlock): at share 0 the
    # event-by-event engine gives the dependency-order engine's timeline, deadlocks included
    rng = random.Random(5000 + seed)
    p = rng.randint(1, 4)
    chunks, layout = rng.choice([(1, "looped"), (2, "v"), (2, "looped")])
    cost = CostModel.from_profile(moe_profile(rng, p), placement(p, chunks, layout))
    S = cost.num_stages
    cost = replace(cost, t_reduce=tuple(rng.choice([0.0, rng.uniform(0.5, 6.0)]) for _ in range(S)),
                   t_opt=tuple(rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in range(S)),
                   t_gather=tuple(rng.choice([0.0, rng.uniform(0.2, 3.0)]) for _ in range(S)) if rng.random() < 0.7 else (),
                   slowdown=tuple(rng.choice([1.0, rng.uniform(1.0, 2.5)]) for _ in range(S)) if rng.random() < 0.7 else ())
    rows = random_order(rng, cost, rng.randint(1, 4), fuse=rng.choice([0.0, 0.4]))
    rows, pairs = pair_up(rng, rows, moves=rng.random() < 0.15)
    alone, shared = _both_engines(rows, cost, pairs, monkeypatch)
    if isinstance(alone, Deadlock):
        assert isinstance(shared, Deadlock) and shared.waits == alone.waits
        return
    assert isinstance(shared, Timeline)
    for field in ("start", "end"):
        assert getattr(shared, field) == [pytest.approx(row, abs=1e-7) for row in getattr(alone, field)]
    assert shared.finish == pytest.approx(alone.finish, abs=1e-7) and shared.begin == pytest.approx(alone.begin, abs=1e-7)
    for field in ("reductions", "gathers"):
        got, want = getattr(shared, field), getattr(alone, field)
        assert [[s for s, _, _ in row] for row in got] == [[s for s, _, _ in row] for row in want]
        assert [_flat(row) for row in got] == [pytest.approx(_flat(row), abs=1e-7) for row in want]
    assert shared.busy == pytest.approx(alone.busy) and shared.overlapped == alone.overlapped
    assert shared.memory == alone.memory
