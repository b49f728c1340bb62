"""Lower bounds never exceed the true optimum: exhaustive search over every schedule of tiny
instances and the exact MILP on small ones, random profiles, memory limits and placements;
plus the cross-rank bound that proves the paper's 1.5B m=24 ZB-2p optimal."""

import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers import make_profile
from tests.helpers.reference import rank_orders
from zbsearch import CostModel, ZbError, resolve_profile
from zbsearch.bounds import (
    memory_makespan_lower_bound,
    memory_span_lower_bound,
    rank_chain_span_lower_bounds,
    rank_memory_span_lower_bounds,
    rank_span_lower_bounds,
    span_lower_bound,
)
from zbsearch.formats.edit import updated
from zbsearch.layout import placement
from zbsearch.limits import parse_memory_limit
from zbsearch.solver import Problem, smallest_feasible_limit, solve
from zbsearch.solver.heuristic import candidate_policies, list_schedule, sequential_schedule
from zbsearch.solver.milp import exact

EPS = 1e-9


def _brute_force(problem: Problem, fifo: bool = True) -> float:
    """The least objective over every combination of rank orders that runs and fits."""
    c, m = problem.cost, problem.num_microbatches
    best = float("inf")
    for rows in itertools.product(*(rank_orders(c, r, m, fifo) for r in range(c.num_ranks))):
        try:
            value, tl = problem.evaluate(list(rows))
        except ZbError:  # the orders deadlock across ranks
            continue
        if problem.fits(tl):
            best = min(best, value)
    return best


def _instance(draw, p: int, chunks: int = 1):
    times = [(draw(st.floats(0.3, 2.0)), draw(st.floats(0.3, 2.0)), draw(st.floats(0.1, 1.5))) for _ in range(p)]
    m_w = draw(st.floats(0.0, 1.0))
    prof = make_profile(p, stages=times, m_w=m_w, t_comm=draw(st.sampled_from([0.0, 0.05, 0.4])))
    cost = CostModel.from_profile(prof, placement(p, 2, "v") if chunks == 2 else list(range(p)))
    return prof, cost


@st.composite
def tiny(draw, sizes=((2, 2), (2, 3), (3, 2))):
    p, m = draw(st.sampled_from(sizes))
    prof, cost = _instance(draw, p)
    least = smallest_feasible_limit(cost, m)
    limit = None if draw(st.booleans()) else [x * draw(st.floats(1.0, 2.0 * m)) for x in least]
    return cost, m, limit


@given(tiny(), st.sampled_from(["span", "makespan"]))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_bounds_never_exceed_the_exhaustive_optimum(case, objective):
    cost, m, limit = case
    problem = Problem(cost, m, None if limit is None else tuple(limit), objective)
    best = _brute_force(problem)
    bound = (memory_span_lower_bound if objective == "span" else memory_makespan_lower_bound)(cost, m, limit)
    assert bound <= best + EPS


@given(tiny(sizes=((2, 2),)))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_microbatch_order_loses_nothing_on_tiny_cases(case):
    # the bounds lean on FIFO being without loss of generality: check it against every order
    cost, m, limit = case
    problem = Problem(cost, m, None if limit is None else tuple(limit))
    assert _brute_force(problem, fifo=False) == pytest.approx(_brute_force(problem, fifo=True), abs=EPS)


@st.composite
def small(draw):
    chunks = draw(st.sampled_from([1, 1, 2]))
    p, m = draw(st.sampled_from([(2, 2)] if chunks == 2 else [(2, 4), (3, 3), (3, 4)]))
    prof, cost = _instance(draw, p, chunks)
    least = smallest_feasible_limit(cost, m)
    limit = None if draw(st.integers(0, 3)) == 0 else [x * draw(st.floats(1.0, 2.0 * m)) for x in least]
    return cost, m, limit


# a V whose W frees 3e-8: within HiGHS's tolerance, the exact model's order peaked at 1.00000003
_TIGHT_V = CostModel(
    stage_to_rank=(0, 1, 1, 0), t_f=(0.5,) * 4, t_b=(0.5,) * 4, t_w=(0.5,) * 4, t_bw=(1.0,) * 4, t_ff=(0.5,) * 4, m_f=(0.5,) * 4,
    m_b=(-0.4999999701976776,) * 4, m_w=(-2.9802322387695312e-08,) * 4, comm_next=(0.0,) * 3,
)


# two stages whose W frees 1.2e-7: HiGHS's order runs the next F before it, 1.00000012 under 1.0
_TIGHT_TWO = CostModel(
    stage_to_rank=(0, 1), t_f=(1.0,) * 2, t_b=(1.0,) * 2, t_w=(1.0,) * 2, t_bw=(2.0,) * 2, t_ff=(1.0,) * 2, m_f=(1.0,) * 2,
    m_b=(-0.9999998807907104,) * 2, m_w=(-1.192092896e-07,) * 2, comm_next=(0.0,),
)


@given(small())
@example(case=(_TIGHT_V, 2, [1.0, 1.0]))
@example(case=(_TIGHT_TWO, 4, [1.0, 1.0]))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_bounds_never_exceed_the_exact_milp_optimum(case):
    cost, m, limit = case
    problem = Problem(cost, m, None if limit is None else tuple(limit))
    res = exact(problem, sequential_schedule(problem), 20)
    assert res is not None
    value, tl = problem.evaluate(res.rows)
    assert problem.fits(tl)
    bound = memory_span_lower_bound(cost, m, limit)
    assert bound <= value + EPS
    # HiGHS's dual bound of the exact model is the optimum when it proved one: ours may not pass
    # it. Unless HiGHS's own order slipped over a memory row within its feasibility tolerance
    # (its order then does not fit and the given one is kept): its optimum is then of a looser
    # problem, below the true one, and only a weaker bound.
    slipped = res.model_value < value - 1e-6 * value
    if res.optimal and not slipped:
        assert bound <= res.dual_bound + 1e-5 * value


@st.composite
def medium(draw):
    chunks = draw(st.sampled_from([1, 2]))
    p = draw(st.integers(2, 5))
    m = draw(st.integers(p, 3 * p))
    prof, cost = _instance(draw, p, chunks)
    least = smallest_feasible_limit(cost, m)
    limit = None if draw(st.integers(0, 3)) == 0 else [x * draw(st.floats(1.0, 2.0 * p)) for x in least]
    return cost, m, limit


@given(medium())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_bounds_hold_for_every_heuristic_schedule_and_are_at_least_the_old_ones(case):
    cost, m, limit = case
    problem = Problem(cost, m, None if limit is None else tuple(limit))
    bound = memory_span_lower_bound(cost, m, limit)
    chain = rank_chain_span_lower_bounds(cost, m, limit)
    per_type = rank_span_lower_bounds(cost, m)
    assert all(c >= cost.rank_busy(r, m) - EPS for r, c in enumerate(chain))
    assert max(chain) <= bound + EPS and max(per_type) <= bound + EPS
    if limit is not None:
        assert max(rank_memory_span_lower_bounds(cost, m, limit)) <= bound + EPS
    schedules = [sequential_schedule(problem)]
    schedules += [out[0] for policy in candidate_policies()[:10] if (out := list_schedule(problem, policy))]
    for rows in schedules:
        value, tl = problem.evaluate(rows)
        if problem.fits(tl):
            assert value >= bound - EPS
            # every rank's own span, not just the longest, is bounded
            assert all(tl.span[r] >= x - EPS for r, x in enumerate(per_type))
            assert all(tl.span[r] >= x - EPS for r, x in enumerate(chain))


def test_the_last_rank_bounds_rank_0_and_proves_zb_2p_optimal_at_m24():
    # 1.5B p=8 m=24: rank 7 must run F and B of all 24 microbatches, which it can start only
    # 7 (T_F + comm) after rank 0 starts; then the last B still has to come down to rank 0
    # and be followed by a W. That is 1152.599 ms of rank 0's span, at any memory limit.
    prof = resolve_profile("1.5b-m24")
    cost = CostModel.from_profile(prof, list(range(8)))
    t = prof.stages[0]
    c = prof.t_comm
    expected = 7 * (t.t_f + c) + 24 * (t.t_f + t.t_b) + 7 * (t.t_b + c) + t.t_w
    assert span_lower_bound(cost, 24) == pytest.approx(expected, abs=1e-9)
    assert expected == pytest.approx(1152.599, abs=1e-3)
    busy = 24 * (t.t_f + t.t_b + t.t_w)
    assert 1 - busy / expected == pytest.approx(0.0433, abs=1e-4)  # the paper's ZB-2p bubble
    res = solve(prof, 24, "2p", time_limit=10, deterministic=True)  # on the work clock: the same at any load
    assert res.info.status == "optimal" and res.info.value == pytest.approx(expected, abs=1e-6)
    assert res.info.lower_bound == pytest.approx(expected, abs=1e-6)


def test_memory_precedences_count_both_stages_of_a_v_rank():
    # V at the smallest limit: the two-stage precedences (room for both stages' activations)
    # raise the bound, which stays below the exact optimum
    prof = make_profile(2, t_comm=0.1)
    cost = CostModel.from_profile(prof, placement(2, 2, "v"))
    m = 3
    least = smallest_feasible_limit(cost, m)
    problem = Problem(cost, m, tuple(least))
    res = exact(problem, sequential_schedule(problem), 30)
    assert res is not None and res.optimal
    optimum = problem.evaluate(res.rows)[0]
    with_memory = max(rank_chain_span_lower_bounds(cost, m, least))
    assert max(rank_chain_span_lower_bounds(cost, m, None)) + 1.0 < with_memory <= optimum + EPS
    assert memory_span_lower_bound(cost, m, least) <= optimum + EPS


def test_chain_bound_certifies_a_heterogeneous_1p_schedule():
    prof = resolve_profile("1.5b-m24")
    stages = [updated(st_, t_f=st_.t_f * f, t_b=st_.t_b * f, t_w=st_.t_w * f)
              for st_, f in zip(prof.stages, [1.2] + [1.0] * 6 + [1.5])]
    prof = updated(prof, stages=stages)
    cost = CostModel.from_profile(prof, list(range(8)))
    limit = parse_memory_limit("1p", prof, cost)
    chain = max(rank_chain_span_lower_bounds(cost, 24, limit))
    assert chain > max(rank_span_lower_bounds(cost, 24)) + 1.0
    problem = Problem(cost, 24, tuple(limit))
    values = [problem.evaluate(out[0])[0] for pol in candidate_policies() if (out := list_schedule(problem, pol))]
    assert min(values) >= chain - EPS
