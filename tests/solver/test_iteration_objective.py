"""The solver on the iteration: each rank's span, then its stages' gradient reductions (those its
passes do not hide) and optimizer steps.

Judged by enumeration: every combination of per-rank orders of tiny instances, each simulated
with the reduction lane (``oracle.brute_force``). No bound may exceed that optimum, no
``optimal`` may be wrong, and the solver's schedules are timed by the simulator."""

from __future__ import annotations

import random

import pytest

import zbsearch as zb
from zbsearch.errors import ZbError
from zbsearch.solver import solve

from .oracle import FAMILIES, brute_force, random_instance

_LIMITS = ("min", "1p", "1.5p", "2p", "none")


def _with_lane(rng: random.Random, profile: zb.Profile) -> zb.Profile:
    """Reductions from nothing to about as long as a stage's passes, some optimizer steps."""
    stages = []
    for st in profile.stages:
        work = st.t_f + st.t_b + st.t_w
        stages.append(st.model_copy(update={"t_reduce": rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]) * work,
                                            "t_opt": rng.choice([0.0, 0.0, 0.125]) * work}))
    return profile.model_copy(update={"stages": stages})


def _tiny(seed: int):
    rng = random.Random(seed)
    chunks = 1 if seed % 3 else 2
    p = rng.choice([2, 3]) if chunks == 1 else 2
    m = rng.choice([1, 2]) if chunks == 1 else 1
    inst = random_instance(rng, FAMILIES[seed % 3], p, m, chunks, rng.choice(_LIMITS))
    return inst, _with_lane(rng, inst.profile)


def _check_solve(seed: int, gathers: bool = False, share: float = 0.0) -> bool:
    """Checks one solve against enumeration; whether it said optimal. ``share``: every rank's
    lane on one link (``LaneSharing``)."""
    inst, prof = _tiny(seed)
    if not prof.has_reductions:
        prof = _with_lane(random.Random(seed + 100), prof)
    if gathers:
        from .test_milp_lane import _with_gathers

        prof = _with_gathers(random.Random(seed + 200), prof)
    if share:
        from zbsearch.formats.profile import DataParallel, LaneSharing

        prof = prof.model_copy(update={"data_parallel": DataParallel(replicas=2, sharing=LaneSharing(share=share))})
        assert zb.CostModel.from_profile(prof, inst.stage_to_rank).lane_share == share
    cost = zb.CostModel.from_profile(prof, inst.stage_to_rank)
    best, _ = brute_force(cost, inst.m, inst.limit, "iteration")
    res = solve(prof, inst.m, inst.limit, chunks=inst.chunks, time_limit=3)  # the default objective: iteration
    info = res.info
    assert info.objective == "iteration"
    tl = zb.simulate(res.schedule.rank_actions, zb.CostModel.from_profile(prof, res.schedule.stage_to_rank))
    assert info.value == pytest.approx(tl.period, rel=1e-12)
    assert info.value >= best * (1 - 1e-9)
    assert info.lower_bound <= best * (1 + 1e-9)
    if info.status == "optimal":
        assert info.value == pytest.approx(best, rel=1e-6)
    assert max(res.schedule.predicted.iteration) == pytest.approx(info.value, rel=1e-12)
    return info.status == "optimal"


@pytest.mark.parametrize("seed", range(16))
def test_iteration_solves_are_sound_against_enumeration(seed):
    _check_solve(seed)


def test_iteration_solves_with_gathers_are_sound_and_proven_against_enumeration():
    # sharded stages gather at the step's start: no bound above the optimum, no false optimal,
    # and the exact model's bound, which prices the gathers, proves most of them
    proven = [_check_solve(seed, gathers=True) for seed in range(10)]
    assert sum(proven) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16, 64))
def test_iteration_solves_are_sound_against_enumeration_on_more_instances(seed):
    _check_solve(seed)


def _bound_instance(seed: int):
    """Every other one on the V, some with two microbatches."""
    rng = random.Random(1000 + seed)
    chunks = 2 if seed % 2 else 1
    p = 2 if chunks == 2 else rng.choice([2, 3])
    m = rng.choice([1, 1, 2]) if chunks == 2 else rng.choice([1, 2])
    inst = random_instance(rng, FAMILIES[seed % 3], p, m, chunks, rng.choice(_LIMITS))
    prof = _with_lane(rng, inst.profile)
    if not prof.has_reductions:
        prof = _with_lane(random.Random(seed), prof)
    return inst, zb.CostModel.from_profile(prof, inst.stage_to_rank)


def _bounds_against_enumeration(seeds) -> int:
    """Checks the iteration bound against the optimum on each instance; how many it raises
    above the span bound plus each rank's smallest reduction (the lane's order at work)."""
    from zbsearch.bounds import _rank_bounds, memory_iteration_lower_bound, rank_iteration_lower_bounds
    from zbsearch.reductions import lane_floors

    raised = 0
    for seed in seeds:
        inst, cost = _bound_instance(seed)
        try:
            best, rows = brute_force(cost, inst.m, inst.limit, "iteration")
        except AssertionError as err:  # too many orders to enumerate
            if "combinations" not in str(err):
                raise
            continue
        bound = memory_iteration_lower_bound(cost, inst.m, inst.limit)
        assert bound <= best * (1 + 1e-9), (seed, bound, best)
        tl = zb.simulate(rows, cost)  # rank by rank too: each rank's bound holds in every schedule
        spans = _rank_bounds(cost, inst.m, inst.limit)
        for got, floor in zip(tl.iteration, rank_iteration_lower_bounds(cost, inst.m, spans)):
            assert floor <= got * (1 + 1e-9), (seed, floor, got)
        simple = max(b + f for b, f in zip(spans, lane_floors(cost)))
        raised += bound > simple * (1 + 1e-9)
    return raised


def test_the_iteration_bound_never_exceeds_the_optimum():
    # on the V the order the stages finish in raises the bound on some of them
    assert _bounds_against_enumeration(range(24)) > 0


@pytest.mark.slow
def test_the_iteration_bound_never_exceeds_the_optimum_on_more_instances():
    assert _bounds_against_enumeration(range(24, 160)) > 0


def test_on_a_v_the_iteration_objective_hides_reductions_the_span_objective_leaves():
    prof = zb.resolve_profile("1.5b-m24")
    from zbsearch.reductions import with_reductions

    prof = with_reductions(prof, 64, 25.0, [3.75e8] * prof.num_stages)
    by_span = solve(prof, 12, "2p", chunks=2, objective="span", time_limit=4)
    by_iteration = solve(prof, 12, "2p", chunks=2, time_limit=4, start=by_span.schedule.rank_actions)
    # given the span's schedule as a start, the iteration's is never longer in iteration
    assert max(by_iteration.schedule.predicted.iteration) <= max(by_span.schedule.predicted.iteration) + 1e-9
    assert by_iteration.info.lower_bound >= by_span.info.lower_bound  # the lane adds at least one reduction


def test_iteration_needs_reductions_in_one_line():
    with pytest.raises(ZbError, match="needs the stages' reduction times"):
        solve(zb.resolve_profile("1.5b-m24"), 8, "2p", objective="iteration", time_limit=1)


def test_ordering_w_passes_for_the_lane_hides_every_ranks_earlier_reduction():
    from zbsearch.reductions import with_reductions
    from zbsearch.solver.lane_order import order_for_lane
    from zbsearch.solver.problem import Problem

    prof = with_reductions(zb.resolve_profile("6.2b-m24"), 64, 25.0, [1.55e9] * 8)
    sched = zb.build_classic("zb-v", prof, 12)
    cost = zb.CostModel.from_profile(prof, sched.stage_to_rank)
    rows = order_for_lane(Problem.make(cost, 12, None, "iteration"), sched.rank_actions)
    before, after = zb.simulate(sched.rank_actions, cost), zb.simulate(rows, cost)
    t = cost.t_reduce[0]  # every piece reduces as long
    assert max(i - s for i, s in zip(before.iteration, before.span)) > 1.5 * t  # ZB-V leaves both on some ranks
    # now every rank's earlier stage's reduction runs beside its last passes: the span plus one
    for i, s in zip(after.iteration, after.span):
        assert i == pytest.approx(s + t)
    assert after.span == pytest.approx(before.span)  # the same passes in the same slots, W passes re-assigned
    for old, new in zip(sched.rank_actions, rows):
        assert [a for a in old if a.op is not zb.Op.W] == [a for a in new if a.op is not zb.Op.W]
        assert sorted(old) == sorted(new)


def test_iteration_solves_with_lanes_sharing_a_link_are_sound_against_enumeration():
    # the bounds and the exact model price every lane at full speed; the simulator, the
    # enumeration's judge, slows runs at once on the shared link: still no bound above the
    # optimum and no false optimal
    for seed in range(6):
        _check_solve(seed, gathers=seed % 2 == 1, share=(0.5, 1.0, 1.5)[seed % 3])
