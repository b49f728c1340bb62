"""The MILP on the iteration: each rank's reduction lane is part of the model.

Judged by enumeration (``oracle.brute_force``: every combination of per-rank orders, each
simulated with the lane): the exact model's dual bound never exceeds the optimum over all
orders, the ASAP model's optimum is the best FIFO order's iteration exactly (enumerated over
FIFO orders alone), and its schedule, re-simulated, has the value the model claims. Windows
never promise less than the simulator then gives."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

import zbsearch as zb
from tests.helpers import make_profile
from zbsearch.layout import placement
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.milp import exact, improve, solve_window
from zbsearch.solver.problem import Problem
from zbsearch.solver.verdict import CLOSED

from .oracle import FAMILIES, brute_force, random_instance, with_fused
from .test_iteration_objective import _with_lane as _drawn_lane

_LIMITS = ("min", "1p", "1.5p", "2p", "none")
TOL = 1e-6  # HiGHS's tolerances and the dual bound's margin


def _with_lane(rng: random.Random, profile: zb.Profile) -> zb.Profile:
    """``test_iteration_objective``'s reductions and steps, with at least one reduction."""
    prof = _drawn_lane(rng, profile)
    if any(st.t_reduce for st in prof.stages):
        return prof
    stages = [prof.stages[0].model_copy(update={"t_reduce": profile.stages[0].t_b}), *prof.stages[1:]]
    return prof.model_copy(update={"stages": stages})


def _with_gathers(rng: random.Random, profile: zb.Profile) -> zb.Profile:
    """Sharded stages: each gathers its parameters at the step's start for nothing up to twice
    its passes' time (on the instances' grid), at least one of them for some time."""
    stages = [st.model_copy(update={"t_gather": rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]) * (st.t_f + st.t_b + st.t_w)})
              for st in profile.stages]
    if not any(st.t_gather for st in stages):
        stages[-1] = stages[-1].model_copy(update={"t_gather": 2 * stages[-1].t_f})
    return profile.model_copy(update={"stages": stages})


def _instance(seed: int, gathers: bool = False):
    """Tiny enough to enumerate: p=2-3 one stage per rank (m=1-2), or p=2 on the V (m=1); every
    fourth with fused backwards that may pay (m=1); ``gathers``, the stages sharded."""
    rng = random.Random(seed)
    chunks = 2 if seed % 2 else 1
    p = 2 if chunks == 2 else rng.choice([2, 3])
    fused = seed % 4 == 2
    m = 1 if fused or chunks == 2 else rng.choice([1, 2])
    inst = random_instance(rng, FAMILIES[seed % 3], p, m, chunks, rng.choice(_LIMITS))
    if fused:
        inst = with_fused(rng, inst)
    prof = _with_lane(rng, inst.profile)
    if gathers:
        prof = _with_gathers(rng, prof)
    problem = Problem(zb.CostModel.from_profile(prof, inst.stage_to_rank), inst.m,
                      None if inst.limit is None else tuple(inst.limit), "iteration")
    return problem, fused


def _check_exact(seed: int, gathers: bool = False) -> tuple[bool, bool]:
    """Whether the exact model's bound reached the optimum, and whether it beat the span
    model's bound plus the least lane floor (the lane's order and overlap at work; with
    ``gathers``, the bound of the model without them)."""
    from zbsearch.reductions import lane_floors

    problem, fused = _instance(seed, gathers)
    cost, m, limit = problem.cost, problem.num_microbatches, problem.limit
    lim = None if limit is None else list(limit)
    best, _ = brute_force(cost, m, lim, "iteration", fused=fused)
    fifo_best, _ = brute_force(cost, m, lim, "iteration", fused=fused, fifo=True)
    start = sequential_schedule(problem)
    relaxed = exact(problem, start, 30, relaxed=True)
    asap = exact(problem, start, 30, relaxed=False)
    assert relaxed is not None and asap is not None
    assert relaxed.optimal and asap.optimal  # tiny: HiGHS proves both
    # the dual bound bounds every schedule, FIFO or not, fused, split or mixed
    assert relaxed.dual_bound <= best * (1 + TOL), (seed, relaxed.dual_bound, best)
    # the ASAP model's optimum is the best FIFO order's iteration, and its order has it
    value = problem.evaluate(asap.rows)[0]
    assert asap.model_value == pytest.approx(fifo_best, rel=TOL), (seed, asap.model_value, fifo_best)
    assert value == pytest.approx(fifo_best, rel=TOL)
    assert problem.evaluate(relaxed.rows)[0] >= best * (1 - TOL)
    if gathers:  # the gathers at work: above the model that leaves them out (the same lane)
        plain = Problem(replace(cost, t_gather=()), m, limit, "iteration")
        old = exact(plain, sequential_schedule(plain), 30, relaxed=True)
        assert old is not None and old.dual_bound <= relaxed.dual_bound * (1 + TOL)
        return relaxed.dual_bound >= best * (1 - TOL), relaxed.dual_bound > old.dual_bound * (1 + TOL)
    span = Problem(cost, m, limit, "span")
    old = exact(span, sequential_schedule(span), 30, relaxed=True)
    assert old is not None
    raised = relaxed.dual_bound > (old.dual_bound + min(lane_floors(cost))) * (1 + TOL)
    return relaxed.dual_bound >= best * (1 - TOL), raised


def test_the_exact_lane_model_against_enumeration():
    got = [_check_exact(seed) for seed in range(24)]
    assert sum(tight for tight, _ in got) >= 18  # mostly the optimum itself
    assert any(raised for _, raised in got)


@pytest.mark.slow
def test_the_exact_lane_model_against_enumeration_on_more_instances():
    got = [_check_exact(seed) for seed in range(24, 160)]
    assert sum(tight for tight, _ in got) >= 100


def test_the_exact_model_with_gathers_against_enumeration():
    # sharded stages: the step starts before the gathers, each stage's first pass waits for its
    # own; the bound stays below every schedule's iteration, and the ASAP model is exact
    got = [_check_exact(seed, gathers=True) for seed in range(24)]
    assert sum(tight for tight, _ in got) >= 15  # the idle relaxation: a rank may start its step late
    assert sum(raised for _, raised in got) >= 12


@pytest.mark.slow
def test_the_exact_model_with_gathers_against_enumeration_on_more_instances():
    got = [_check_exact(seed, gathers=True) for seed in range(24, 160)]
    assert sum(tight for tight, _ in got) >= 90


def _medium(seed: int, gathers: bool = False) -> Problem:
    rng = random.Random(500 + seed)
    chunks = 2 if seed % 2 else 1
    p = rng.choice([2, 3]) if chunks == 2 else rng.choice([3, 4])
    inst = random_instance(rng, FAMILIES[seed % 3], p, rng.choice([4, 5, 6]), chunks, rng.choice(_LIMITS))
    prof = _with_lane(rng, inst.profile)
    if gathers:
        prof = _with_gathers(rng, prof)
    return Problem(zb.CostModel.from_profile(prof, inst.stage_to_rank), inst.m,
                   None if inst.limit is None else tuple(inst.limit), "iteration")


@pytest.mark.parametrize(("seed", "gathers"), [(0, False), (1, False), (2, False), (3, False), (4, True), (5, True)])
def test_windows_never_promise_less_than_the_simulator_gives(seed, gathers):
    # every window of a list schedule: its model's value is an upper bound on the iteration of
    # its order re-simulated, and an optimal window is no worse than the schedule it started from
    problem = _medium(seed, gathers)
    rows = sequential_schedule(problem)
    value, tl = problem.evaluate(rows)
    horizon = max(e[-1] for e in tl.end)
    length = horizon / 3
    t1, solved = 0.0, 0
    while t1 < horizon:
        res = solve_window(problem, rows, tl, t1, t1 + length, length, 5.0)
        if res is not None:
            got = problem.evaluate(res.rows)[0]
            assert got <= res.model_value * (1 + TOL) + TOL, (seed, t1, got, res.model_value)
            if res.optimal:
                assert res.model_value <= value * (1 + TOL)
                solved += 1
        t1 += length / 2
    assert solved > 0
    # the search built on them ends no worse than it started, on the iteration
    found, stats = improve(problem, rows, time.monotonic() + 3.0)
    assert problem.evaluate(found)[0] <= value * (1 + 1e-12)
    assert stats.windows > 0


def test_the_iteration_optimum_trades_span_for_hidden_reductions():
    # a V on two ranks, each holding two stages whose reductions take 2 ms: the span-optimal
    # order ends each rank with both stages' last backwards, so both reductions follow the
    # span; the iteration-optimal one ends a stage early, at a longer span, and hides its reduction
    prof = make_profile(2, t_comm=0.1)
    prof = prof.model_copy(update={"stages": [s.model_copy(update={"t_reduce": 4.0}) for s in prof.stages]})
    rows = zb.build_classic("zb-v", prof, 2).rank_actions
    cost = zb.CostModel.from_profile(prof, placement(2, 2, "v"))
    iteration, span = Problem(cost, 2, None, "iteration"), Problem(cost, 2, None, "span")
    by_iteration, by_span = exact(iteration, rows, 30, relaxed=False), exact(span, rows, 30, relaxed=False)
    bound = exact(iteration, rows, 30, relaxed=True)
    assert by_iteration is not None and by_span is not None and bound is not None
    assert by_iteration.optimal and by_span.optimal and bound.optimal
    best, tl = iteration.evaluate(by_iteration.rows)
    assert bound.dual_bound <= best <= bound.dual_bound * (1 + CLOSED)  # proven optimal for the iteration
    other, tl_span = iteration.evaluate(by_span.rows)
    assert best < other - 0.5
    assert max(tl.span) > max(tl_span.span)
    assert max(i - s for i, s in zip(tl.iteration, tl.span)) < 2 * cost.t_reduce[0]
