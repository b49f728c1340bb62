"""The V schedule built around overlapped pairs, and the pairing bound, on generated MoE
profiles: checked by the validator and the simulator, against DualPipeV built apart."""

from __future__ import annotations

import random

import pytest

from tests.test_overlap import moe_profile
from zbsearch import CostModel, Profile, StageCost
from zbsearch.bounds import rank_pairing_span_lower_bounds, rank_span_lower_bounds
from zbsearch.classic import KINDS
from zbsearch.formats.schedule import Schedule
from zbsearch.layout import placement
from zbsearch.simulator import simulate
from zbsearch.solver.paired_v import paired_v, paired_v_candidates
from zbsearch.solver.problem import Problem
from zbsearch.validator import find_problem


def _uniform(p: int, share: float) -> Profile:
    st = StageCost(t_f=2.0, t_b=2.0, t_w=1.6, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=share * 2.0, a_b=share * 2.0)
    return Profile(name="moe", memory_unit="activations", stages=[st] * p, t_comm=0.05)


@pytest.mark.parametrize("seed", range(12))
def test_paired_v_valid_with_every_pair_past_the_warm_up(seed):
    rng = random.Random(seed)
    p = rng.choice([2, 3, 4])
    m = 2 * p + rng.randint(0, 5)
    prof = moe_profile(rng, p)
    place = placement(p, 2, "v")
    cost = CostModel.from_profile(prof, place)
    for lag in (0, 1):
        for ramp in (True, False, *range(p)):
            rows, pairs = paired_v(cost, m, lag, ramp)
            sched = Schedule.build("paired-v", prof, m, place, rows, overlapped=pairs)
            assert find_problem(sched) is None, (seed, lag, ramp)
            # (the validator checks every pass runs once) every rank pairs all but its warm-up (2m - 2p
            # pairs), and all but its unpaired ramp steps (p-1-r of them with the ramp unpaired, none
            # paired in full, those before its last k with k)
            depth = (p if ramp else 0) if isinstance(ramp, bool) else ramp
            assert [len(p_) for p_ in pairs] == [2 * m - 2 * p - max(0, p - 1 - r - depth) for r in range(p)], (seed, lag)


@pytest.mark.parametrize("p", [3, 4, 6])
def test_paired_v_beats_dualpipe_v_in_its_memory(p):
    # DeepSeek-like stages, m=6p: more pairs, and each pair's B sends its gradient on before its W
    cost = CostModel.from_profile(_uniform(p, 0.3), placement(p, 2, "v"))
    m, dual = 6 * p, KINDS["dualpipe-v"]
    dv = simulate(dual.build(cost, m), cost, dual.pairs(cost, m))
    rows, pairs = paired_v(cost, m, 0)
    tl = simulate(rows, cost, pairs)
    assert max(tl.span) < max(dv.span)
    assert max(tl.peak_memory) <= max(dv.peak_memory) + 1e-9
    assert sum(map(len, pairs)) > sum(map(len, dual.pairs(cost, m)))


@pytest.mark.parametrize("p", [3, 4, 6])
def test_paired_v_unpaired_ramp_waits_less(p):
    # uniform stages: the ramp pairs make neighbouring ranks wait on each other's pairs, which
    # costs more than they hide; without them the same memory gives a shorter span
    cost = CostModel.from_profile(_uniform(p, 0.3), placement(p, 2, "v"))
    (paired, pp), (plain, pq) = paired_v(cost, 4 * p, 0, True), paired_v(cost, 4 * p, 0, False)
    a, b = simulate(paired, cost, pp), simulate(plain, cost, pq)
    assert max(b.span) < max(a.span)
    assert max(b.peak_memory) <= max(a.peak_memory) + 1e-9


@pytest.mark.parametrize("p,m", [(4, 8), (6, 12), (8, 16)])
def test_a_ramp_paired_in_its_last_steps_offered_where_it_is_faster(p, m):
    # at 40% all-to-all a late ramp pair hides more than its rank waits for it: the candidate with
    # the ramp paired in its last k steps is offered exactly when some k beats both ends, and the
    # one offered is the fastest k (each k simulated here apart from the search for it; 0: unpaired, p-1: in full)
    cost = CostModel.from_profile(_uniform(p, 0.4), placement(p, 2, "v"))
    spans = {k: max(simulate(rows, cost, pairs).span) for k in range(p) for rows, pairs in [paired_v(cost, m, 0, k)]}
    best = min(range(1, p - 1), key=spans.get)
    offered = [n for n, _, _ in paired_v_candidates(Problem.make(cost, m)) if "last" in n]
    if spans[best] < min(spans[0], spans[p - 1]) - 1e-9:
        assert offered == [f"paired v (W lag {lag}, ramp paired in its last {best} steps)" for lag in (0, 1)], spans
    else:
        assert offered == [], spans


def test_paired_v_offered_only_where_it_applies():
    prof = _uniform(4, 0.3)
    cost = CostModel.from_profile(prof, placement(4, 2, "v"))
    assert [n for n, _, _ in paired_v_candidates(Problem.make(cost, 8))] == [
        "paired v (W lag 0)", "paired v (W lag 1)", "paired v (W lag 0, ramp unpaired)", "paired v (W lag 1, ramp unpaired)"]
    assert paired_v_candidates(Problem.make(cost, 7)) == []  # m < 2p
    assert paired_v_candidates(Problem.make(cost.without_all_to_all(), 8)) == []
    assert paired_v_candidates(Problem.make(cost, 8, (0.5,) * 4)) == []  # over the limit


def test_pairing_bound_raises_the_floor_and_holds_for_the_schedules():
    for share in (0.2, 0.3, 0.4):
        cost = CostModel.from_profile(_uniform(4, share), placement(4, 2, "v"))
        pairing = rank_pairing_span_lower_bounds(cost, 16)
        assert min(pairing) > max(rank_span_lower_bounds(cost, 16))
        rows, pairs = paired_v(cost, 16, 0)
        assert all(b <= s + 1e-9 for b, s in zip(pairing, simulate(rows, cost, pairs).span))
    assert rank_pairing_span_lower_bounds(cost.without_all_to_all(), 16) == [0.0] * 4
