"""The iteration's end on a mesh: reductions after each stage's last backward, the optimizer step."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import zbsearch as zb
from tests.helpers import make_profile
from tests.helpers.reference import random_cost, random_order
from zbsearch.actions import Op
from zbsearch.formats.profile import Quartiles, pass_time_fields
from zbsearch.reductions import reduction_time, with_measured_reductions, with_reductions
from zbsearch.simulator import simulate


def _lane_end_closed_form(row, ends, t_reduce) -> float:
    """One lane with release times in a fixed order: its last completion is the largest, over
    each job k, of k's release plus the work of k and every job after it."""
    ready = {}
    for a, e in zip(row, ends):
        if a.op in (Op.W, Op.BW):
            ready[a.stage] = max(ready.get(a.stage, 0.0), e)  # compute is sequential: the latest end
    jobs = sorted(ready.items(), key=lambda kv: kv[1])
    return max((r + sum(t_reduce[s] for s, _ in jobs[k:]) for k, (_, r) in enumerate(jobs)), default=0.0)


@pytest.mark.parametrize("seed", range(40))
def test_each_rank_ends_when_its_lane_and_its_passes_have_ended(seed):
    rng = random.Random(seed)
    p = rng.choice([1, 2, 3, 4])
    cost = random_cost(rng, p, rng.choice([1, 2]), rng.choice(["looped", "v"]))
    S = cost.num_stages
    t_red = tuple(rng.choice([0.0, rng.uniform(0.1, 5.0)]) for _ in range(S))
    t_opt = tuple(rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in range(S))
    lane_cost = replace(cost, t_reduce=t_red, t_opt=t_opt)
    rows = random_order(rng, cost, rng.randint(1, 4), fuse=rng.random())
    plain, tl = simulate(rows, cost), simulate(rows, lane_cost)
    assert tl.start == plain.start and tl.end == plain.end  # the lane never slows the passes
    for r, row in enumerate(rows):
        if not row:
            continue
        opt = sum(t_opt[s] for s in {a.stage for a in row})
        want = max(plain.end[r][-1], _lane_end_closed_form(row, plain.end[r], t_red)) + opt
        assert tl.finish[r] == pytest.approx(want)
        assert plain.span[r] <= tl.iteration[r] <= plain.span[r] + sum(t_red[s] for s in {a.stage for a in row}) + opt + 1e-9
        for (_, _, end), (_, start2, _) in zip(tl.reductions[r], tl.reductions[r][1:]):
            assert end <= start2 + 1e-12  # one at a time
        assert {s for s, _, _ in tl.reductions[r]} == {a.stage for a in row if a.op in (Op.W, Op.BW)}
    assert tl.period == max(tl.iteration)


def test_without_reductions_the_iteration_is_the_span():
    prof = zb.resolve_profile("1.5b-m24")
    assert not prof.has_reductions
    s = zb.build_classic("zb-h1", prof, 24)
    tl = simulate(s.rank_actions, zb.CostModel.from_profile(prof, s.stage_to_rank))
    assert tl.iteration == tl.span and tl.reductions == [] and s.predicted.iteration is None


def test_a_schedule_with_a_tail_hides_a_reduction_and_one_without_pays_it():
    base = zb.Profile(name="u", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.6, m_w=-0.4)] * 4)
    prof = with_reductions(base, 8, 1000.0, [4e6] * 4)  # 2(8-1)/8 of 4 MB at 1000 GB/s: 7 us
    t = prof.stages[0].t_reduce
    assert t == pytest.approx(2 * 7 / 8 * 4e6 / 1e12 * 1e3)
    one = zb.build_classic("zb-h1", prof, 8)  # every rank's last pass is its stage's last W
    assert all(i == pytest.approx(s + t) for s, i in zip(one.predicted.span, one.predicted.iteration))
    v = zb.build_classic("zb-v", prof, 8)  # rank 0's second stage finishes before its first
    (s0, start0, end0), _ = simulate(v.rank_actions, zb.CostModel.from_profile(prof, v.stage_to_rank)).reductions[0]
    assert s0 == 7 and start0 < v.predicted.span[0]


def test_reduction_times_follow_the_ring():
    assert reduction_time(1e9, 1, 10.0) == 0.0
    assert reduction_time(1e9, 2, 1.0) == pytest.approx(1000.0)  # 2(2-1)/2 of 1 GB at 1 GB/s
    assert reduction_time(1e9, 2, 1.0, sharded=True) == pytest.approx(500.0)
    assert reduction_time(8e9, 8, 2.0) == pytest.approx(2 * 7 / 8 * 8e9 / 2e9 * 1e3)
    assert reduction_time(0.0, 4, 1.0, latency_ms=0.5) == pytest.approx(6 * 0.5)


def test_reductions_are_no_pass_times_and_survive_a_file(tmp_path):
    assert "t_reduce" not in pass_time_fields() and "t_opt" not in pass_time_fields()
    prof = with_reductions(zb.resolve_profile("1.5b-m24"), 16, 50.0, [3.75e8] * 8, t_opt=[2.0] * 8)
    zb.save_profile(prof, tmp_path / "p.json")
    back = zb.load_profile(tmp_path / "p.json")
    assert back == prof and back.data_parallel.replicas == 16 and back.has_reductions
    with pytest.raises(zb.ZbError, match="one gradient size"):
        with_reductions(prof, 2, 1.0, [1.0])


# ---- sharded stages: the parameters gathered at the step's start --------------------------------

def _gathering(t_gather, t_reduce, stage_to_rank):
    S = len(stage_to_rank)
    return zb.CostModel(stage_to_rank=tuple(stage_to_rank), t_f=(1.0,) * S, t_b=(1.0,) * S, t_w=(1.0,) * S,
                        t_bw=(2.0,) * S, t_ff=(1.0,) * S, m_f=(1.0,) * S, m_b=(-0.5,) * S, m_w=(-0.5,) * S,
                        comm_next=(0.0,) * (S - 1), t_reduce=tuple(t_reduce), t_opt=(0.0,) * S, t_gather=tuple(t_gather))


def test_a_stages_first_pass_waits_for_its_gather_and_the_iteration_counts_it():
    # by hand: rank 0 gathers 2 ms, so F0 runs 2-3; rank 1's F 3-4 (its 0.5 ms gather hidden
    # behind the wait), B 4-5, W 5-6; rank 0's B 5-6, W 6-7; reductions 7-8 and 6-7. The lanes
    # run the gathers from the origin (0-2, 0-0.5), where the simulator slows passes beside them;
    # rank 0's step starts at 0 (its gather ends at its first pass), rank 1's at 2.5 (3 - 0.5).
    cost = _gathering((2.0, 0.5), (1.0, 1.0), (0, 1))
    rows = [[zb.Action(s, op, 0) for op in (Op.F, Op.B, Op.W)] for s in (0, 1)]
    tl = simulate(rows, cost)
    assert tl.start == [[2.0, 5.0, 6.0], [3.0, 4.0, 5.0]]
    assert tl.gathers == [[(0, 0.0, 2.0)], [(1, 0.0, 0.5)]]
    assert tl.begin == [0.0, 2.5]
    assert tl.iteration == [8.0, 4.5]
    assert tl.period == 8.0


def test_on_a_v_the_rank_gathers_in_stage_order_and_the_later_stage_waits_for_both():
    # rank 0 holds stages 0 and 3: its gathers run 0-1 (stage 0) then 1-11 (stage 3), so stage
    # 3's forward, ready at 4, starts at 11
    cost = _gathering((1.0, 0.0, 0.0, 10.0), (0.0,) * 4, (0, 1, 1, 0))
    rows = [[zb.Action(0, Op.F, 0), zb.Action(3, Op.F, 0), zb.Action(3, Op.B, 0), zb.Action(3, Op.W, 0),
             zb.Action(0, Op.B, 0), zb.Action(0, Op.W, 0)],
            [zb.Action(1, Op.F, 0), zb.Action(2, Op.F, 0), zb.Action(2, Op.B, 0), zb.Action(2, Op.W, 0),
             zb.Action(1, Op.B, 0), zb.Action(1, Op.W, 0)]]
    tl = simulate(rows, cost)
    assert tl.start[0][:2] == [1.0, 11.0]
    assert tl.gathers[0] == [(0, 0.0, 1.0), (3, 1.0, 11.0)]
    assert tl.begin[0] == 0.0 and tl.iteration[0] == tl.end[0][-1]


def test_sharded_reductions_gather_as_many_bytes_and_old_files_mean_none(tmp_path):
    prof = zb.resolve_profile("1.5b-m24")
    assert zb.CostModel.from_profile(prof, list(range(8))).t_gather == ()
    plain = with_reductions(prof, 8, 50.0, [3e8] * 8)
    assert all(st.t_gather is None for st in plain.stages)
    sharded = with_reductions(prof, 8, 50.0, [3e8] * 8, sharded=True)
    assert [st.t_gather for st in sharded.stages] == [reduction_time(3e8, 8, 50.0, sharded=True)] * 8
    path = tmp_path / "p.json"
    zb.save_profile(sharded, path)
    again = zb.load_profile(str(path))
    assert zb.CostModel.from_profile(again, list(range(8))).t_gather == (reduction_time(3e8, 8, 50.0, sharded=True),) * 8


@pytest.mark.parametrize("seed", range(4))
def test_the_iteration_bound_with_gathers_never_exceeds_the_optimum(seed):
    from tests.solver.oracle import brute_force
    from zbsearch.bounds import memory_iteration_lower_bound

    rng = random.Random(seed)
    place = [(0, 1), (0, 1, 2), (0, 1, 1, 0)][seed % 3]
    S = len(place)
    cost = _gathering([rng.choice([0.0, 0.5, 2.0, 4.0]) for _ in range(S)], [rng.choice([0.0, 1.0, 3.0]) for _ in range(S)],
                      place)
    m = 1 if S > 2 else 2
    best, rows = brute_force(cost, m, None, "iteration")
    bound = memory_iteration_lower_bound(cost, m, None)
    assert bound <= best * (1 + 1e-9), (bound, best)
    # the gathers only add: the bound is at least the one without them
    without = memory_iteration_lower_bound(replace(cost, t_gather=()), m, None)
    assert bound >= without - 1e-9


@pytest.mark.parametrize("what", ["slowdown", "stretch"])
def test_a_measured_factor_of_the_wrong_length_is_named_in_the_error(what):
    spread = [Quartiles(median=1.0, q1=1.0, q3=1.0, mean=1.0)] * 4
    with pytest.raises(zb.ZbError, match=f"give one {what} per stage"):
        with_measured_reductions(make_profile(4), 2, spread, [1e6] * 4, group="local", backend="gloo",
                                 **{what: spread[:3]})
