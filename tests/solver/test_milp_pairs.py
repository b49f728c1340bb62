"""MILP windows with overlapped pairs, on MoE costs (all-to-all a share of F and B, V placement).

A window chooses the pairs among its passes and keeps those outside it; its model's value is an
upper bound on what the simulator gives its rows and pairs, and an optimal window is no worse
than the schedule it started from. Pairs after the window enter its tails as one unit each.
"""

from __future__ import annotations

import time

import pytest

from zbsearch import CostModel, Profile, Schedule, StageCost, build_classic, find_problem
from zbsearch.layout import placement
from zbsearch.simulator import simulate
from zbsearch.solver.milp import improve_paired, solve_window
from zbsearch.solver.paired_v import paired_v
from zbsearch.solver.problem import Problem

TOL = 1e-6  # HiGHS's tolerances (1e-7 on rows): a model value may sit that far below its schedule's


def _moe(p: int, share: float, t_comm: float = 0.05) -> Profile:
    st = StageCost(t_f=2.0, t_b=2.0, t_w=1.6, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=share * 2.0, a_b=share * 2.0)
    return Profile(name=f"moe-p{p}", memory_unit="activations", stages=[st] * p, t_comm=t_comm, ep=8)


def _paired_set(rows, pairs) -> set:
    return {(r, rows[r][i], rows[r][i + 1]) for r, at in enumerate(pairs or []) for i in at}


def _check(prof: Profile, problem: Problem, rows, pairs) -> None:
    sched = Schedule.build("x", prof, problem.num_microbatches, list(problem.cost.stage_to_rank), rows,
                           memory_limit=list(problem.limit) if problem.limit else None, overlapped=pairs)
    assert find_problem(sched) is None


@pytest.mark.parametrize("objective", ["span", pytest.param("makespan", marks=pytest.mark.slow)])
def test_windows_keep_the_pairs_outside_and_never_promise_less(objective):
    p, m = 2, 5
    prof = _moe(p, 0.4)
    cost = CostModel.from_profile(prof, placement(p, 2, "v"))
    rows, pairs = paired_v(cost, m)
    limit = tuple([max(simulate(rows, cost, pairs).peak_memory)] * p)
    problem = Problem(cost, m, limit, objective)
    value, tl = problem.evaluate(rows, pairs)
    horizon = max(e[-1] for e in tl.end)
    length = horizon / 3
    t1, solved, chosen = 0.0, 0, 0
    given = _paired_set(rows, pairs)
    while t1 < horizon:
        res = solve_window(problem, rows, tl, t1, t1 + length, length, 3.0, pairs=pairs)
        if res is not None:
            got, tl2 = problem.evaluate(res.rows, res.pairs)
            assert got <= res.model_value * (1 + TOL) + TOL, (t1, got, res.model_value)
            assert problem.fits(tl2)
            _check(prof, problem, res.rows, res.pairs)
            outside = {x for x in given if not t1 <= tl.start[x[0]][rows[x[0]].index(x[1])] < t1 + length}
            assert outside <= _paired_set(res.rows, res.pairs), t1  # kept as they were
            chosen += bool(_paired_set(res.rows, res.pairs) - outside)
            if res.optimal:
                assert res.model_value <= value * (1 + TOL)
                solved += 1
        t1 += length / 2
    assert solved > 0 and chosen > 0


def test_a_window_over_the_whole_schedule_pairs_where_that_pays():
    # from ZB-H1, which has no pairs, the exact window (everything, no band) finds a schedule
    # with pairs shorter than every one without (the same costs without all-to-all: no pairs)
    p, m = 2, 4
    prof = _moe(p, 0.4)
    cost = CostModel.from_profile(prof, placement(p, 1, "v"))
    start = [list(r) for r in build_classic("zb-h1", prof, m).rank_actions]
    limit = tuple(max(simulate(start, cost).peak_memory) for _ in range(p))
    problem = Problem(cost, m, limit, "makespan")
    value, tl = problem.evaluate(start)
    res = solve_window(problem, start, tl, 0.0, float("inf"), float("inf"), 60.0, secondary=False)
    assert res is not None and res.optimal
    got, tl2 = problem.evaluate(res.rows, res.pairs)
    assert res.pairs is not None and got < value * (1 - 1e-6) and problem.fits(tl2)
    _check(prof, problem, res.rows, res.pairs)
    plain = Problem(cost.without_all_to_all(), m, limit, "makespan")
    res0 = solve_window(plain, start, plain.evaluate(start)[1], 0.0, float("inf"), float("inf"), 60.0, secondary=False)
    assert res0 is not None and res0.pairs is None
    assert res0.optimal and res0.dual_bound > got * (1 + 1e-3)  # every schedule without pairs is slower


def test_the_window_search_with_pairs_ends_no_worse_and_valid():
    p, m = 2, 6
    prof = _moe(p, 0.3)
    cost = CostModel.from_profile(prof, placement(p, 2, "v"))
    rows, pairs = paired_v(cost, m)
    problem = Problem(cost, m, tuple([max(simulate(rows, cost, pairs).peak_memory)] * p), "span")
    value = problem.evaluate(rows, pairs)[0]
    found, got_pairs, stats = improve_paired(problem, rows, pairs, time.monotonic() + 3.0)
    new, tl = problem.evaluate(found, got_pairs)
    assert new <= value * (1 + 1e-12) and problem.fits(tl) and stats.windows > 0
    _check(prof, problem, found, got_pairs)
