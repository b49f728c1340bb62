"""Time limits as mechanisms: what each piece does once its deadline has passed.

No test here measures time (machines are noisy; bench/solver.py --only limits does). A
deadline already in the past is deterministic: each test checks that the work is cut where
it should be and that what comes back is still a valid, honest result.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import make_profile
from zbsearch import CostModel, find_problem, resolve_profile
from zbsearch.bounds import memory_span_lower_bound, rank_chain_span_lower_bounds
from zbsearch.classic import KINDS
from zbsearch.classic.zb_v import zb_v
from zbsearch.compare import SOLVED_KINDS, compare
from zbsearch.layout import placement
from zbsearch.limits import parse_memory_limit
from zbsearch.simulator import simulate
from zbsearch.solver import frontier, solve
from zbsearch.solver.heuristic import candidate_policies, list_schedule
from zbsearch.solver.problem import Problem


def _past() -> float:
    return time.monotonic() - 1.0


def _problem(limit: str = "2p", m: int = 64) -> Problem:
    prof = resolve_profile("1.5b-m24")
    cost = CostModel.from_profile(prof, list(range(prof.num_ranks)))
    lim = parse_memory_limit(limit, prof, cost)
    return Problem(cost, m, None if lim is None else tuple(lim))


def test_list_schedule_is_cut_at_a_past_deadline():
    problem, policy = _problem(), candidate_policies()[0]
    assert list_schedule(problem, policy) is not None
    assert list_schedule(problem, policy, _past()) is None
    assert list_schedule(problem, policy, time.monotonic() + 3600) == list_schedule(problem, policy)


@pytest.mark.parametrize("limit, fallback", [("2p", "zb-h2"), ("1p", "zb-h1"), ("0.7p", "sequential")])
def test_expired_solve_returns_a_valid_fallback_and_says_time_limit(limit, fallback):
    """With no time at all no list schedule runs: the first classic order within the limit
    (ZB-H2 needs about 2p, ZB-H1 1p) or else the sequential schedule comes back, validated, with its gap and a
    status that says so."""
    prof = resolve_profile("1.5b-m24")
    res = solve(prof, 48, limit, time_limit=0.0)
    assert res.info.construction == fallback
    # "optimal" only where the bound proves it (ZB-H1 at 1p is), else the cut is said
    assert res.info.status == ("optimal" if res.info.gap <= 1e-6 else "time_limit")
    assert find_problem(res.schedule) is None
    cost = CostModel.from_profile(prof, res.schedule.stage_to_rank)
    assert res.info.value == max(simulate(res.schedule.rank_actions, cost).span)


def test_chain_bound_is_left_out_after_its_deadline():
    cost = _problem().cost
    limit = list(_problem().limit or ())
    assert rank_chain_span_lower_bounds(cost, 24, limit, _past()) is None
    quick = memory_span_lower_bound(cost, 24, limit, quick=True)
    full = memory_span_lower_bound(cost, 24, limit)
    assert memory_span_lower_bound(cost, 24, limit, deadline=_past()) == quick <= full


def test_zb_v_keeps_its_first_construction_after_the_deadline():
    prof = make_profile(4, t_f=1.0, t_b=1.3, t_w=0.6, t_comm=0.1)
    cost = CostModel.from_profile(prof, placement(4, 2, "v"))
    first = zb_v(cost, 12, _past())
    best = zb_v(cost, 12)
    assert max(simulate(best, cost).span) <= max(simulate(first, cost).span)
    limit = [4 * cost.activation_unit(r) for r in range(4)]
    assert all(pk <= lim + 1e-9 for pk, lim in zip(simulate(first, cost).peak_memory, limit))


def test_compare_lists_rows_it_had_no_time_for_as_skipped():
    prof = resolve_profile("1.5b-m24")
    rows = compare(prof, 24, time_limit=0.0)
    assert [r["kind"] for r in rows] == [*KINDS, *SOLVED_KINDS]
    assert all("skipped" in r and "time limit" in r["skipped"] for r in rows)
    full = compare(prof, 24, time_limit=60.0)
    assert not any("skipped" in r for r in full)
    assert {r["status"] for r in full if r["kind"] in SOLVED_KINDS} <= {"optimal", "feasible", "time_limit"}


def test_frontier_without_time_still_gives_a_valid_point_and_reports_progress():
    prof = resolve_profile("1.5b-m24")
    seen: list[str] = []
    fr = frontier(prof, 24, time_limit=0.0, progress=lambda phase, value, bound: seen.append(phase))
    assert len(fr.points) >= 1
    assert seen[0].startswith("no limit: ") and any(s.startswith(f"{fr.points[0].limit:.4g}p (1/") for s in seen)
    rates = [pt.bubble_rate for pt in fr.points]
    assert rates == sorted(rates, reverse=True)
