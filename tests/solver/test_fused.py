"""Certificates over split, fused and mixed schedules, and a solver that fuses where it pays.

A schedule may run each microbatch's backward on each stage as one fused BW (t_bw, its F at
t_ff) or as a B then a W. Where a BW costs less than B + W the best schedule may fuse some
backwards and split others. Judged against the exact oracle over mixed schedules
(``oracle.py``, ``fused=True``, itself checked here against brute-force enumeration of every
fused subset and order): no bound above the optimum, no false 'optimal', never worse than
the best classic schedule within the limit. Generated instances have t_bw below t_b + t_w by
0 to 60% and t_ff up to 10% below t_f (``with_fused``). The larger sweep is bench/fused.py.
"""

from __future__ import annotations

import random
import time
from decimal import Decimal

import pytest

from tests.helpers import make_profile
from zbsearch import CostModel, Schedule, build_classic, find_problem, timeline
from zbsearch.actions import Op
from zbsearch.formats.edit import updated
from zbsearch.solver import Problem, gap_text, solve
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.solve import SolverInfo
from zbsearch.solver.verdict import CLOSED, decide_status, status_text

from .harness import TOL, judge
from .oracle import FAMILIES, brute_force, cp_optimum_many, random_instance, with_fused

_LIMITS = ("min", "1p", "1.5p", "2p", "none")


def _tiny(seed: int):
    """Small enough to enumerate every fused subset and every order."""
    rng = random.Random(seed)
    chunks = 2 if seed % 4 == 3 else 1
    m = 1 if chunks == 2 else rng.choice([1, 2])
    inst = random_instance(rng, FAMILIES[seed % 3], 2, m, chunks, rng.choice(_LIMITS))
    return with_fused(rng, inst)


@pytest.mark.parametrize("seed", range(6))
def test_the_mixed_oracle_equals_brute_force_over_fused_subsets_and_orders(seed):
    inst = _tiny(seed)
    for objective in ("span", "makespan"):
        mixed, _ = brute_force(inst.cost, inst.m, inst.limit, objective, fused=True)
        asap, idle, split = cp_optimum_many([(inst.cost, inst.m, inst.limit, objective, opts) for opts in (
            {"fused": True}, {"fused": True, "semantics": "idle"}, {})])
        assert asap.optimal and asap.value == pytest.approx(mixed, rel=1e-12)
        assert idle.value <= mixed * (1 + 1e-12)  # free idle relaxes ASAP
        assert split.value >= mixed * (1 - 1e-12)  # split schedules are some of the mixed ones


def _sample(count: int, seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chunks = 2 if i % 4 == 1 else 1
        p, m = rng.choice([(2, 2), (2, 3), (3, 2)] if chunks == 1 else [(2, 2)])  # the mixed oracle in seconds
        out.append(with_fused(rng, random_instance(rng, FAMILIES[i // 2 % 3], p, m, chunks, rng.choice(_LIMITS))))
    return out


@pytest.fixture(scope="module")
def verdicts():
    jobs = [(inst, "span") for inst in _sample(9, 2024)]  # (makespan: the brute-force test and bench/fused.py)
    opts = cp_optimum_many([(i.cost, i.m, i.limit, o, {"fused": True}) for i, o in jobs], time_limit=10, processes=2)
    proven = [(inst, obj, opt) for (inst, obj), opt in zip(jobs, opts) if opt.optimal]
    assert len(proven) >= len(jobs) - 1
    # a short limit: every claim below must hold however far the search got
    return [(inst, obj, judge(inst, obj, opt.value, time_limit=1.0)) for inst, obj, opt in proven]


def test_bounds_hold_over_mixed_schedules(verdicts):
    bad = [(v.unsound(), v.optimum) for _, _, v in verdicts if v.unsound()]
    assert not bad


def test_optimal_only_when_it_is_over_mixed_schedules(verdicts):
    assert not [(v.value, v.optimum) for _, _, v in verdicts if v.false_optimal]


def test_schedules_are_valid_never_beat_the_mixed_optimum_and_the_classic_ones(verdicts):
    for _, _, v in verdicts:
        assert v.problem is None
        assert not v.below_optimum, (v.value, v.optimum)  # else the oracle missed a schedule
        assert not v.classic or v.value <= min(v.classic.values()) * (1 + TOL)


def test_the_local_search_reaches_mixed_optima(verdicts):
    # fusing or splitting one backward is a move: from the split sequential schedule the search
    # reaches the optimum over mixed schedules (a budget of evaluations, not of seconds)
    from zbsearch.solver.local_search import local_search

    reached = []
    for inst, objective, v in verdicts:
        problem = Problem(inst.cost, inst.m, tuple(inst.limit) if inst.limit else None, objective)
        found = local_search(problem, sequential_schedule(problem), float("inf"), target=v.optimum * (1 + TOL),
                             evaluations=20_000)
        value = problem.evaluate(found)[0]
        assert value >= v.optimum * (1 - TOL)
        reached.append(value <= v.optimum * (1 + TOL))
    assert sum(reached) >= 0.8 * len(reached), reached


def test_the_relaxed_exact_bound_is_below_the_mixed_optimum(verdicts):
    from zbsearch.solver.milp import exact

    for inst, objective, v in verdicts[:6]:
        problem = Problem(inst.cost, inst.m, tuple(inst.limit) if inst.limit else None, objective)
        res = exact(problem, sequential_schedule(problem), 1.0, relaxed=True)
        assert res is not None and res.dual_bound <= v.optimum * (1 + TOL)
        assert problem.evaluate(res.rows)[0] >= v.optimum * (1 - TOL)  # its schedule, re-simulated


# ---------------------------------------------------------------------------------------------
# Profiles where fusing pays, as on a CPU: a fused backward costs about T_W, B + W about 2.4x it.


def _cpu_like(p: int = 2):
    prof = make_profile(p, t_f=6.0, t_b=15.0, t_w=11.0)
    return updated(prof, stages=[updated(s, t_bw=11.0, t_ff=5.8) for s in prof.stages], name="cpu-like")


@pytest.mark.parametrize("chunks,m", [(1, 4), (2, 4)])
def test_bound_is_below_1f1b_and_solve_beats_it_where_fusing_pays(chunks, m):
    prof = _cpu_like()
    kind = "1f1b" if chunks == 1 else "interleaved-1f1b"
    classic = max(timeline(build_classic(kind, prof, m, None if chunks == 1 else 2)).span)
    res = solve(prof, m, "2p", chunks=chunks, time_limit=3)
    assert res.info.lower_bound <= classic * (1 + TOL)
    assert res.info.value <= classic * (1 + TOL)
    assert res.info.value <= min(res.info.classic.values()) * (1 + TOL)
    assert res.info.fused_backwards > 0
    assert find_problem(res.schedule) is None


def test_a_fused_only_result_says_the_split_did_not_pay():
    # B + W at 3x a BW, no bubble a W could fill better: every backward fused
    prof = make_profile(2, t_f=1.0, t_b=2.0, t_w=1.0)
    prof = updated(prof, stages=[updated(s, t_bw=1.0) for s in prof.stages])
    res = solve(prof, 6, "1p", time_limit=2, milp=False)
    assert res.info.split_backwards == 0 and res.info.fused_backwards == 2 * 6
    from zbsearch.solver import explain

    lines = explain(res.schedule, res.info)
    assert any("did not pay" in line and "3x" in line for line in lines)
    assert res.schedule.kind in res.info.classic or res.schedule.kind.startswith("fused")


@pytest.mark.parametrize("ratio", [0.4, 0.7, 1.0])
def test_solve_is_never_worse_than_the_best_classic_schedule(ratio):
    rng = random.Random(int(ratio * 10))
    stages = [(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.3, 2)) for _ in range(4)]
    prof = make_profile(4, stages=stages, t_comm=0.05)
    prof = updated(prof, stages=[updated(s, t_bw=ratio * (s.t_b + s.t_w)) for s in prof.stages])
    for limit in ("1p", "2p"):
        res = solve(prof, 8, limit, time_limit=1, milp=False)
        assert res.info.classic and res.info.value <= min(res.info.classic.values()) * (1 + TOL)


@pytest.mark.parametrize("chunks", [1, 2])
def test_fused_list_policies_give_valid_schedules_timed_as_the_simulator_does(chunks):
    from zbsearch.layout import placement
    from zbsearch.solver.heuristic import candidate_policies, list_schedule

    rng = random.Random(chunks)
    prof = make_profile(4, stages=[(rng.uniform(0.5, 1.5), rng.uniform(0.8, 1.6), rng.uniform(0.5, 1.2)) for _ in range(4)],
                        t_comm=0.05)
    prof = updated(prof, stages=[updated(s, t_bw=0.7 * (s.t_b + s.t_w), t_ff=0.95 * s.t_f) for s in prof.stages])
    stage_to_rank = placement(4, chunks, "v")
    cost = CostModel.from_profile(prof, stage_to_rank)
    built = 0
    for limit in (1.0, 2.0):
        problem = Problem(cost, 8, tuple(limit * 4 * cost.activation_unit(r) for r in range(4)))
        for policy in [q for q in candidate_policies(problem) if q.fuse >= 0][:9]:
            out = list_schedule(problem, policy)
            if out is None:
                continue
            rows, own = out
            value, tl = problem.evaluate(rows)
            assert value <= own * (1 + 1e-9)  # the scheduler's own timing, never below the simulator's
            assert problem.fits(tl)
            sched = Schedule.build("x", prof, 8, stage_to_rank, rows, memory_limit=list(problem.limit))
            assert find_problem(sched) is None
            built += any(a.op is Op.BW for row in rows for a in row)
    assert built


def test_milp_windows_keep_mixed_schedules_valid_and_no_worse():
    from zbsearch.solver.heuristic import candidate_policies, list_schedule
    from zbsearch.solver.milp import improve

    prof = _cpu_like(3)
    cost = CostModel.from_profile(prof, [0, 1, 2])
    problem = Problem(cost, 6, tuple(2 * 3 * cost.activation_unit(r) for r in range(3)))
    policy = next(q for q in candidate_policies(problem) if q.fuse == 1.0)
    rows = list_schedule(problem, policy)[0]
    rows = [row[:] for row in rows]
    assert any(a.op is Op.BW for row in rows for a in row) and any(a.op is Op.W for row in rows for a in row)
    before = problem.evaluate(rows)[0]
    new, stats = improve(problem, rows, time.monotonic() + 2.0)
    value, tl = problem.evaluate(new)
    assert stats.windows and value <= before * (1 + 1e-9) and problem.fits(tl)
    assert find_problem(Schedule.build("x", prof, 6, [0, 1, 2], new, memory_limit=list(problem.limit))) is None


def test_profiles_without_t_bw_get_split_schedules_and_the_split_bound():
    prof = make_profile(3, stages=[(1.0, 1.2, 0.8), (1.1, 1.0, 0.9), (0.9, 1.3, 0.7)], t_comm=0.1)
    cost = CostModel.from_profile(prof, [0, 1, 2])
    assert not cost.fusing_may_pay() and cost.for_bounds() is cost
    res = solve(prof, 4, "1p", time_limit=2)
    assert res.info.fused_backwards == 0 and not any(a.op is Op.BW for row in res.schedule.rank_actions for a in row)


def test_for_bounds_holds_no_more_memory_where_a_b_allocates():
    # m_b > 0 > m_w: a BW never holds B's peak, so the relaxed split model must not either
    prof = make_profile(2)
    prof = updated(prof, stages=[updated(s, m_f=1.0, m_b=0.25, m_w=-1.25) for s in prof.stages])
    cost = CostModel.from_profile(prof, [0, 1])
    assert cost.fusing_may_pay()
    relaxed = cost.for_bounds()
    assert relaxed.m_b == (-1.0, -1.0) and relaxed.m_w == (0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# The status line: what decides it, printed so that the numbers agree with the word.


@pytest.mark.parametrize("gap", [0.0, 5e-7, 1.000001e-6, CLOSED, CLOSED * (1 + 1e-6), 3e-6, 1e-4, 0.0213])
def test_status_line_prints_the_gap_on_the_side_of_the_threshold_that_decides(gap):
    from zbsearch.solver.milp import _DUAL_MARGIN

    assert CLOSED >= _DUAL_MARGIN + 1e-6  # an optimum the MILP proves (its bound less the margin) is one
    status = decide_status(gap, hit_limit=False)
    info = SolverInfo(method="heuristic", construction="x", objective="span", status=status, value=1 + gap,
                      lower_bound=1.0, gap=gap, time_s=0.1, time_limit_s=1.0, memory_limit=None, uniform_costs=False)
    text = status_text(info)
    assert text.startswith(f"gap {gap_text(gap)}")
    shown = Decimal(gap_text(gap).rstrip("%"))
    assert (status == "optimal") == (gap <= CLOSED)
    assert ("<=" in text) == (status == "optimal") and f"status {status}" in text
    assert (shown <= Decimal(repr(CLOSED * 100))) == (gap <= CLOSED)  # the printed percentage, against CLOSED
