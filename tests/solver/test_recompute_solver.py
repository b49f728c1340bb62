"""The solver with recomputation: what ``--recompute`` promises, and the searches' own models of
recompute passes against the core simulator.

Optimality claims are judged against the exact oracle in ``test_recompute_oracle.py``; here:
schedules valid within the limit, recomputing as asked, never worse than the classic ones the
solver compares with, and the local search's fast simulator equal to ``zbsearch.simulate``.
"""

from __future__ import annotations

import random

import pytest

import zbsearch as zb
from tests.helpers import make_profile
from zbsearch.actions import RECOMPUTES, Action, Op
from zbsearch.solver import frontier, smallest_feasible_limit, solve
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.milp import improve
from zbsearch.solver.problem import Problem

pytestmark = pytest.mark.slow

_PAPER = zb.load_profile("1.5b-m24")


def _recomputed(rows) -> int:
    return sum(a.op in RECOMPUTES for row in rows for a in row)


def test_auto_at_half_of_1f1bs_memory_beats_1f1b_with_full_recomputation():
    res = solve(_PAPER, 24, "0.5p", recompute="auto", time_limit=3, milp=False)
    assert zb.find_problem(res.schedule) is None
    assert res.info.recompute == "auto" and res.info.recomputed == _recomputed(res.schedule.rank_actions) > 0
    assert max(res.timeline.peak_memory) <= 4.0 * (1 + 1e-9)
    # built here: the solver compares with the classic kinds only as far as its time allows
    full = zb.build_classic("1f1b-recompute", _PAPER, 24)
    assert res.info.value < 0.8 * max(full.predicted.span)
    assert res.info.lower_bound <= res.info.value


def test_full_recomputes_every_forward_and_none_recomputes_nothing():
    full = solve(_PAPER, 8, "0.5p", recompute="full", time_limit=2, milp=False)
    assert zb.find_problem(full.schedule) is None
    assert _recomputed(full.schedule.rank_actions) == 8 * 8
    assert all(a.op is not Op.RS for row in full.schedule.rank_actions for a in row)
    plain = solve(_PAPER, 8, "1p", time_limit=2, milp=False)
    assert _recomputed(plain.schedule.rank_actions) == 0 and plain.info.recompute == "none"


def test_recompute_needs_the_profiles_costs():
    prof = make_profile(4)
    with pytest.raises(zb.ZbError, match="--recompute auto: profile 'unit' has no recomputation costs"):
        solve(prof, 8, "1p", recompute="auto", time_limit=1)
    half = prof.model_copy(update={"stages": [st.model_copy(update={"t_r": 1.0, "m_fc": 0.1}) if i else st
                                              for i, st in enumerate(prof.stages)]})
    with pytest.raises(zb.ZbError, match="--recompute full: .* for stage 0"):
        solve(half, 8, "1p", recompute="full", time_limit=1)
    with pytest.raises(zb.ZbError, match="recompute must be one of none, auto, full"):
        solve(prof, 8, "1p", recompute="some", time_limit=1)  # type: ignore[arg-type]


def test_below_one_microbatch_on_the_v_only_with_recomputation():
    prof = make_profile(4, keep=0.125)
    least = smallest_feasible_limit(zb.CostModel.from_profile(prof, zb.placement(4, 2, "v")), 8, "auto")
    # one chunk's activations (half a stage's) and what the other keeps (its input: not halved)
    assert max(least) == pytest.approx(0.5 + 0.125)
    with pytest.raises(zb.ZbError, match="with --recompute auto it is lower"):
        solve(prof, 8, least, chunks=2, time_limit=1)
    res = solve(prof, 8, least, chunks=2, recompute="auto", time_limit=2, milp=False)
    assert zb.find_problem(res.schedule) is None and res.info.recomputed > 0


def test_frontier_with_recomputation_starts_lower_and_never_rises():
    prof = make_profile(4, keep=0.125, t_comm=0.05)
    fr = frontier(prof, 8, chunks=2, recompute="auto", time_limit=4)
    plain = frontier(prof, 8, chunks=2, time_limit=2)
    assert fr.recompute == "auto" and fr.points[0].limit < plain.points[0].limit
    rates = [pt.bubble_rate for pt in fr.points]
    assert all(b <= a + 1e-12 for a, b in zip(rates, rates[1:]))
    assert fr.points[0].recomputed > 0


def test_v_at_v_halfs_memory_is_never_longer_than_v_half():
    prof = make_profile(8, 2.0, 2.0, 2.0, m_w=1.0)  # unit chunks; B frees nothing
    half = zb.build_classic("v-half", prof, 24)
    limit = [max(half.predicted.peak_memory)] * 8
    res = solve(prof, 24, limit, chunks=2, time_limit=3, milp=False)
    assert res.info.value <= max(half.predicted.span) * (1 + 1e-9)


def _random_recompute_rows(rng, problem):
    """The sequential schedule with a random choice of microbatches recomputed, each recompute
    pass at a random place between its F and its backward."""
    rows = [list(row) for row in sequential_schedule(problem)]
    for row in rows:
        for a in [a for a in row if a.op is Op.F]:
            ops = problem.cost.recompute_ops(a.stage)
            if ops and rng.random() < 0.5:
                lo = row.index(a) + 1
                hi = next(i for i, b in enumerate(row) if b.op in (Op.B, Op.BW) and (b.stage, b.mb) == (a.stage, a.mb))
                row.insert(rng.randint(lo, hi), Action(a.stage, rng.choice(ops), a.mb))
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_local_search_model_times_recompute_passes_as_the_simulator(seed):
    from zbsearch.solver.local_search import _Model

    rng = random.Random(seed)
    prof = make_profile(3, 1.0, 1.5, 0.5, keep=0.25, t_comm=0.125)
    prof = prof.model_copy(update={"stages": [st.model_copy(update={"t_rs": 0.25, "m_fs": 0.5}) for st in prof.stages]})
    problem = Problem.make(zb.CostModel.from_profile(prof, zb.placement(3, 2, "v") if seed % 2 else [0, 1, 2]), 3,
                           recompute="auto")
    model = _Model(problem)
    for _ in range(20):
        rows = _random_recompute_rows(rng, problem)
        state = (frozenset(), frozenset((a.stage, a.mb, a.op) for row in rows for a in row if a.op in RECOMPUTES))
        ids = [[model.id[(a.stage, a.op, a.mb)] for a in row] for row in rows]
        score = model.score(ids, model.costs(state)[0])
        tl = zb.simulate(rows, problem.cost)
        assert score is not None and score[0] == pytest.approx(max(tl.span))


def test_milp_windows_keep_recompute_passes_valid():
    prof = make_profile(4, keep=0.125, t_comm=0.05)
    cost = zb.CostModel.from_profile(prof, [0, 1, 2, 3])
    problem = Problem.make(cost, 6, (2.5,) * 4, recompute="auto")
    rows = _random_recompute_rows(random.Random(3), problem)
    assert problem.fits_order(rows)
    before, _ = problem.evaluate(rows)
    out, stats = improve(problem, rows, deadline=__import__("time").monotonic() + 3)
    sched = zb.Schedule.build("w", prof, 6, [0, 1, 2, 3], out, memory_limit=[2.5] * 4)
    assert zb.find_problem(sched) is None and stats.windows > 0
    assert problem.evaluate(out)[0] <= before
    # the windows keep each microbatch's recomputation as it was
    assert {(a.stage, a.mb, a.op) for row in out for a in row if a.op in RECOMPUTES} == \
        {(a.stage, a.mb, a.op) for row in rows for a in row if a.op in RECOMPUTES}
