"""The schedule solver: known optima found and proven, valid output within the limit, both
paths (heuristic only, MILP), infeasible limits, time limits, and bounds that hold."""

import json
import subprocess

import pytest

from tests.helpers import cli_command, make_profile
from zbsearch import CostModel, Schedule, find_problem, parse_memory_limit, resolve_profile, simulate
from zbsearch.bounds import memory_span_lower_bound, rank_memory_span_lower_bounds
from zbsearch.errors import ZbError
from zbsearch.formats.edit import updated
from zbsearch.solver import Problem, smallest_feasible_limit, solve
from zbsearch.solver.frontier import frontier
from zbsearch.solver.heuristic import candidate_policies, list_schedule, sequential_schedule
from zbsearch.solver.milp import exact, solve_window
from zbsearch.solver.verdict import CLOSED


def _check(res, limit_spec):
    """Valid, within its limit, and the numbers in the file are the simulator's."""
    sched = res.schedule
    cost = CostModel.from_profile(sched.profile, sched.stage_to_rank)
    limit = parse_memory_limit(limit_spec, sched.profile, cost) if isinstance(limit_spec, str) else limit_spec
    assert find_problem(sched, memory_limit=limit) is None
    tl = simulate(sched.rank_actions, cost)
    assert res.info.value == pytest.approx(max(tl.span) if res.info.objective == "span" else tl.makespan)
    assert res.info.value >= res.info.lower_bound * (1 - 1e-9)
    assert sched.solver.status == res.info.status


def test_unit_costs_2p_large_m_is_zero_bubble_and_proven():
    res = solve(make_profile(4), 16, "2p", time_limit=5)
    _check(res, "2p")
    assert res.schedule.predicted.bubble_rate == pytest.approx(0.0, abs=1e-12)
    assert res.info.status == "optimal" and res.info.gap <= CLOSED


def test_1p_is_proven_optimal_on_a_paper_profile():
    # ZB-H1's bubble is the least possible at 1p: the memory-aware bound certifies it
    res = solve(resolve_profile("1.5b-m24"), 24, "1p", time_limit=5)
    _check(res, "1p")
    assert res.info.status == "optimal"
    assert res.schedule.predicted.bubble_rate == pytest.approx(0.1585, abs=1e-4)


def test_smallest_limit_forces_one_microbatch_at_a_time_and_is_proven():
    prof = make_profile(4, t_comm=0.1)
    res = solve(prof, 6, "0.25p", time_limit=5)
    _check(res, "0.25p")
    assert res.info.status == "optimal"
    # each rank finishes a microbatch (F B W) before starting the next
    for row in res.schedule.rank_actions:
        assert [a.mb for a in row] == sorted(a.mb for a in row)
    assert res.info.value == pytest.approx(simulate(sequential_schedule(Problem(CostModel.from_profile(prof, list(range(4))), 6)),
                                                    CostModel.from_profile(prof, list(range(4)))).span[0])


def test_infeasible_limit_names_the_smallest_feasible_one():
    with pytest.raises(ZbError, match=r"smallest feasible limit for this profile is 0\.25p"):
        solve(make_profile(4), 8, "0.2p")
    cost = CostModel.from_profile(make_profile(3), [0, 1, 2, 2, 1, 0])
    assert smallest_feasible_limit(cost, 4) == pytest.approx([1.0, 1.0, 1.0])


def test_heuristic_only_and_milp_paths():
    prof = make_profile(4, stages=[(1.2, 1.3, 0.7), (1.0, 1.1, 0.6), (1.0, 1.1, 0.6), (2.0, 2.2, 1.3)], t_comm=0.05)
    fast = solve(prof, 4, "0.75p", milp=False, time_limit=5)
    _check(fast, "0.75p")
    assert fast.info.method == "heuristic" and fast.info.milp_windows == 0 and fast.info.gap > 0
    slow = solve(prof, 4, "0.75p", time_limit=10)
    _check(slow, "0.75p")
    # the local search over orders or the exact MILP closes the gap
    assert slow.info.method == "heuristic+milp" and slow.info.milp_improvements + slow.info.search_improvements >= 1
    assert slow.info.value < fast.info.value - 1e-6 and slow.info.status == "optimal"


def test_exact_milp_closes_the_gap_on_a_small_case():
    prof = make_profile(3, stages=[(1.0, 1.5, 0.5), (1.0, 1.5, 0.5), (1.8, 2.4, 0.9)], t_comm=0.1)
    res = solve(prof, 4, "1p", time_limit=20)
    _check(res, "1p")
    assert res.info.status == "optimal" and res.info.gap <= CLOSED


def test_time_limit_returns_the_best_so_far_with_its_gap():
    prof = resolve_profile("14.6b-m48")
    res = solve(prof, 48, "2p", time_limit=1.0)
    _check(res, "2p")
    assert res.info.status in ("time_limit", "optimal") and res.info.gap >= 0
    assert res.info.time_limit_s == 1.0 and res.schedule.solver.gap == res.info.gap


@pytest.mark.parametrize("chunks,limit", [(1, "1.5p"), (2, "1p"), (2, "0.5p"), (1, None)])
def test_every_output_validates_and_respects_the_limit(chunks, limit):
    prof = make_profile(4, stages=[(1.2, 1.2, 0.6), (1.0, 1.0, 0.5), (1.0, 1.1, 0.5), (1.5, 1.6, 0.8)], t_comm=0.05)
    res = solve(prof, 8, limit, chunks=chunks, time_limit=1.5)
    _check(res, limit)
    assert res.schedule.chunks == chunks


def test_makespan_objective_and_byte_budget():
    prof = make_profile(4, t_comm=0.1)
    prof = updated(prof, memory_unit="bytes", stages=[updated(s, m_f=2**30, m_b=-(2**29), m_w=-(2**29)) for s in prof.stages])
    res = solve(prof, 8, "4GiB", objective="makespan", time_limit=3)
    _check(res, "4GiB")
    assert res.info.objective == "makespan" and res.schedule.predicted.makespan == pytest.approx(res.info.value)
    with pytest.raises(ZbError, match=r"smallest feasible limit for this profile is 1 GiB"):
        solve(prof, 8, "0.5GiB")


def test_true_costs_beat_uniform_costs_on_a_heterogeneous_profile():
    prof = make_profile(4, stages=[(1.2, 1.2, 0.6), (1.0, 1.0, 0.5), (1.0, 1.0, 0.5), (2.0, 2.0, 1.0)], t_comm=0.02)
    true = solve(prof, 8, "1p", milp=False)
    uniform = solve(prof, 8, "1p", milp=False, uniform_costs=True)
    _check(uniform, "1p")
    assert uniform.info.uniform_costs and uniform.schedule.profile == prof
    assert true.info.value < 0.95 * uniform.info.value


@pytest.mark.parametrize("limit", ["0.5p", "1p", "1.5p"])
def test_memory_bound_holds_against_exact_optimum_and_every_heuristic(limit):
    prof = make_profile(2, stages=[(1.0, 1.4, 0.6), (1.3, 1.6, 0.5)], t_comm=0.2)
    cost = CostModel.from_profile(prof, [0, 1])
    m = 3
    L = parse_memory_limit(limit, prof, cost)
    problem = Problem(cost, m, tuple(L))
    bound = memory_span_lower_bound(cost, m, L)
    assert all(b >= cost.rank_busy(r, m) for r, b in enumerate(rank_memory_span_lower_bounds(cost, m, L)))
    for policy in candidate_policies():
        out = list_schedule(problem, policy)
        if out is not None:
            value, tl = problem.evaluate(out[0])
            if problem.fits(tl):
                assert value >= bound - 1e-9
    res = exact(problem, sequential_schedule(problem), 20)
    assert res is not None and res.optimal
    assert problem.evaluate(res.rows)[0] >= bound - 1e-9
    assert res.dual_bound <= problem.evaluate(res.rows)[0] + 1e-6


def test_window_never_worsens_and_keeps_the_limit():
    prof = resolve_profile("1.5b-m24")
    cost = CostModel.from_profile(prof, list(range(8)))
    problem = Problem(cost, 24, tuple(parse_memory_limit("2p", prof, cost)))
    rows = list_schedule(problem, candidate_policies()[2])[0]
    value, tl = problem.evaluate(rows)
    for t1 in (0.0, 300.0, 800.0):
        res = solve_window(problem, rows, tl, t1, t1 + 120.0, 120.0, 2.0)
        assert res is not None
        v2, tl2 = problem.evaluate(res.rows)
        assert v2 <= res.model_value + 1e-6 and res.model_value <= value + 1e-6
        assert problem.fits(tl2)
        sched = Schedule.build("x", prof, 24, list(range(8)), res.rows, memory_limit=list(problem.limit))
        assert find_problem(sched) is None


def test_frontier_falls_from_the_smallest_limit():
    # time enough to reach the unlimited rate on a loaded machine (about half a second alone: every
    # point's solve ends once proven or its searches end); a sweep out of time stops early by design
    fr = frontier(make_profile(4, t_comm=0.05), 8, time_limit=8)
    assert fr.points[0].limit == pytest.approx(0.25)
    rates = [pt.bubble_rate for pt in fr.points]
    assert all(b <= a + 1e-12 for a, b in zip(rates, rates[1:]))
    assert rates[-1] == pytest.approx(fr.unlimited_bubble_rate)
    assert all(pt.bound_bubble_rate <= pt.bubble_rate + 1e-9 for pt in fr.points)


def _cli(*args):
    return subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True)


def test_cli_solve_writes_a_validated_schedule_with_a_solver_section(tmp_path):
    out = tmp_path / "zb1p.json"
    r = _cli("solve", "--profile", "unit-p4", "-m", "8", "--mem-limit", "1p", "-t", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "status optimal" in r.stdout and "gap 0.00%" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["solver"]["status"] == "optimal" and doc["predicted"]["bubble_rate"] >= 0
    assert _cli("validate", out).returncode == 0


def test_cli_infeasible_limit_is_one_line(tmp_path):
    r = _cli("solve", "--profile", "unit-p4", "-m", "8", "--mem-limit", "0.1p")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "smallest feasible limit" in r.stderr


def test_cli_frontier_json(tmp_path):
    out = tmp_path / "f.json"
    r = _cli("frontier", "--profile", "unit-p4", "-m", "8", "-t", "1", "-o", out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == "zbsearch.frontier" and doc["points"][0]["limit"] == pytest.approx(0.25)


def test_plain_list_policy_gives_a_valid_v_schedule_under_a_limit():
    from zbsearch.layout import placement
    from zbsearch.solver.heuristic import Policy, list_schedule

    prof = make_profile(4, stages=[(1.0, 1.2, 0.6), (1.5, 1.6, 0.8), (1.0, 1.0, 0.5), (2.0, 2.0, 1.0)])
    cost = CostModel.from_profile(prof, placement(4, 2, "v"))
    limit = [cost.activation_unit(r) * 4 for r in range(4)]
    rows, _ = list_schedule(Problem(cost, 8, tuple(limit)), Policy())
    assert find_problem(Schedule.build("greedy-v", prof, 8, placement(4, 2, "v"), rows, memory_limit=limit)) is None


def test_window_search_stops_once_the_bound_is_reached():
    import time

    from zbsearch.solver.milp import improve

    prof = resolve_profile("1.5b-m24")
    cost = CostModel.from_profile(prof, list(range(8)))
    problem = Problem(cost, 24, tuple(parse_memory_limit("2p", prof, cost)))
    rows = list_schedule(problem, candidate_policies()[0])[0]
    value = problem.evaluate(rows)[0]
    t0 = time.monotonic()
    out, stats = improve(problem, rows, t0 + 30, target=value)
    assert stats.windows == 0 and stats.converged and out == rows
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------------------------------------
# Limits that are limits (the mechanism; elapsed against the limit is measured in bench/solver.py)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_spent_time_limit_still_returns_a_valid_schedule(chunks):
    prof = make_profile(4, stages=[(1.0, 2.0, 1.5), (1.5, 1.0, 0.5), (1.0, 1.0, 1.0), (2.0, 1.5, 1.0)], t_comm=0.1)
    res = solve(prof, 16, "1.5p", chunks=chunks, time_limit=0.0)
    _check(res, "1.5p")
    assert res.info.milp_windows == 0  # nothing searched past the deadline
    assert res.info.status == "time_limit" or res.info.gap <= 1e-6


def _rising(values):
    return [(a, b) for a, b in zip(values, values[1:]) if b > a * (1 + 1e-12)]


@pytest.mark.parametrize("name, m, chunks, milp", [("cpu-gpt-tiny", 8, 2, True), ("1.5b-m24", 24, 1, False)])
def test_frontier_never_rises_on_the_issues_cases(name, m, chunks, milp):
    fr = frontier(resolve_profile(name), m, chunks=chunks, time_limit=4, milp=milp)
    rates = [pt.bubble_rate for pt in fr.points]
    assert not _rising(rates)
    assert fr.unlimited_bubble_rate <= rates[-1] + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_more_memory_is_never_worse_given_the_smaller_limits_schedule(seed):
    import random

    rng = random.Random(seed)
    prof = make_profile(4, stages=[tuple(rng.uniform(0.5, 2.5) for _ in range(3)) for _ in range(4)], t_comm=rng.uniform(0, 0.3))
    best, values = None, []
    for limit in ("1p", "1.25p", "1.5p", "2p", "none"):
        res = solve(prof, 12, limit, chunks=1 + seed % 2, milp=False, start=best, time_limit=2)
        best = res.schedule.rank_actions
        values.append(res.info.value)
    assert not _rising(values)


def test_the_milp_path_writes_nothing_to_stdout(capfd, tmp_path):
    """HiGHS prints a banner from C when a model is made: neither a library call nor
    ``solve -o -`` (whose stdout is the schedule JSON) may show it."""
    import json
    import subprocess

    from tests.helpers import cli_command
    from zbsearch import Profile, StageCost, save_profile

    # two measured stages (a first stage whose backward is all W's, fused backwards cheaper):
    # the MILP windows run, so HiGHS makes models
    prof = Profile(name="two", memory_unit="bytes", t_comm=0.036, stages=[
        StageCost(t_f=0.368, t_b=0.035, t_w=0.49, t_bw=0.465, t_ff=0.356, m_f=66816, m_b=0, m_w=-66816),
        StageCost(t_f=0.882, t_b=0.517, t_w=0.229, t_bw=0.582, t_ff=0.488, m_f=140804, m_b=-108036, m_w=-32768),
    ])
    res = solve(prof, 4, "2p", time_limit=5)
    assert res.info.milp_windows >= 1
    assert capfd.readouterr().out == ""
    save_profile(prof, tmp_path / "p.json")
    r = subprocess.run([*cli_command(), "solve", "-p", str(tmp_path / "p.json"), "-m", "4", "-t", "5", "-o", "-"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "zbsearch.schedule"
