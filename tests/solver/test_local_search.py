"""The local search over per-rank orders: never invalid, never worse, within the memory limit,
stops at its deadline, and reaches non-FIFO optima that the exact oracle proves."""

from __future__ import annotations

import random
import time

import pytest

from zbsearch import Schedule, find_problem
from zbsearch.actions import Action, Op
from zbsearch.solver import Problem
from zbsearch.solver.heuristic import candidate_policies, list_schedule, sequential_schedule
from zbsearch.solver.local_search import local_search

from .oracle import FAMILIES, cp_optimum, cp_optimum_many, issue_counterexample, random_instance, with_fused
from .test_oracle import _heavy_rank_instance

_LIMITS = ("min", "1p", "1.5p", "2p", "none")
_NEVER = float("inf")  # no deadline: the tests bound the search by evaluations instead


def _problem(inst, objective: str = "span") -> Problem:
    return Problem(inst.cost, inst.m, tuple(inst.limit) if inst.limit is not None else None, objective)


def _starts(problem: Problem):
    """Schedules to start from: the sequential one and a list schedule."""
    yield sequential_schedule(problem)
    out = list_schedule(problem, candidate_policies()[0])
    if out is not None:
        yield out[0]


def _generated(seed: int):
    rng = random.Random(seed)
    chunks = 1 + seed % 2
    p, m = rng.choice([(2, 3), (3, 3), (4, 2)] if chunks == 1 else [(2, 2), (3, 2)])
    return random_instance(rng, FAMILIES[seed % 3], p, m, chunks, rng.choice(_LIMITS))


@pytest.mark.parametrize("seed", range(12))
def test_never_invalid_never_worse_always_within_the_limit(seed):
    inst = _generated(seed)
    for objective in ("span", "makespan"):
        problem = _problem(inst, objective)
        for rows in _starts(problem):
            before, _ = problem.evaluate(rows)
            found = local_search(problem, rows, _NEVER, seed=seed, evaluations=400)
            sched = Schedule.build("ls", inst.profile, inst.m, inst.stage_to_rank, found, memory_limit=inst.limit)
            assert find_problem(sched, memory_limit=inst.limit) is None
            value, tl = problem.evaluate(found)
            assert value <= before and problem.fits(tl)
            assert sorted(map(str, sum(found, []))) == sorted(map(str, sum(rows, [])))


def test_an_expired_deadline_or_budget_returns_the_input():
    inst = _generated(1)
    problem = _problem(inst)
    rows = sequential_schedule(problem)
    assert local_search(problem, rows, time.monotonic() - 1.0) is rows
    assert local_search(problem, rows, _NEVER, evaluations=0) is rows


def test_a_target_already_met_or_fused_passes_return_the_input():
    inst = _generated(2)
    problem = _problem(inst)
    rows = sequential_schedule(problem)
    value, _ = problem.evaluate(rows)
    assert local_search(problem, rows, _NEVER, target=value) is rows
    fused = [[a for a in row if a.op is not Op.W] for row in rows]
    fused = [[a if a.op is not Op.B else type(a)(a.stage, Op.BW, a.mb) for a in row] for row in fused]
    assert local_search(problem, fused, _NEVER, evaluations=50) is fused


def test_the_smallest_limit_holds_one_microbatch_at_a_time():
    # at the smallest limit every candidate that would hold two microbatches is refused
    rng = random.Random(5)
    inst = random_instance(rng, "hetero", 3, 3, 1, "min")
    problem = _problem(inst)
    found = local_search(problem, sequential_schedule(problem), _NEVER, evaluations=300)
    _, tl = problem.evaluate(found)
    assert all(pk <= lim * (1 + 1e-9) for pk, lim in zip(tl.peak_memory, inst.limit))


def test_reaches_the_non_fifo_optima_of_the_issue_and_the_heavy_rank_case():
    inst = issue_counterexample()
    problem = _problem(inst)
    found = local_search(problem, sequential_schedule(problem), _NEVER, target=12.56 + 1e-9, evaluations=20_000)
    assert problem.evaluate(found)[0] == pytest.approx(12.56)  # FIFO orders reach 13.56 at best
    prof, limit = _heavy_rank_instance()
    from zbsearch import CostModel

    cost = CostModel.from_profile(prof, [0, 1, 2])
    best = cp_optimum(cost, 2, limit).value
    problem = Problem(cost, 2, tuple(limit), "span")
    found = local_search(problem, sequential_schedule(problem), _NEVER, target=best * (1 + 1e-9), evaluations=20_000)
    assert problem.evaluate(found)[0] == pytest.approx(best)


def _oracle_family():
    rng = random.Random(77)
    out = []
    for i in range(12):
        chunks = 1 + i % 2
        p, m = rng.choice([(2, 2), (2, 3), (3, 2), (3, 3)] if chunks == 1 else [(2, 2), (3, 2)])
        out.append(random_instance(rng, FAMILIES[i % 3], p, m, chunks, rng.choice(_LIMITS)))
    return out


def test_reaches_the_proven_optimum_on_small_generated_instances():
    """From the sequential schedule (the worst start), with a budget of evaluations, on span and
    makespan: every instance the oracle proves is solved to its optimum."""
    insts = _oracle_family()
    jobs = [(inst, obj) for inst in insts for obj in ("span", "makespan")]
    opts = cp_optimum_many([(i.cost, i.m, i.limit, o, {}) for i, o in jobs], time_limit=20, processes=2)
    missed = []
    for (inst, obj), opt in zip(jobs, opts):
        if not opt.optimal:
            continue
        problem = _problem(inst, obj)
        found = local_search(problem, sequential_schedule(problem), _NEVER, target=opt.value * (1 + 1e-9),
                             evaluations=30_000)
        value = problem.evaluate(found)[0]
        assert value >= opt.value * (1 - 1e-9)  # else the oracle missed a schedule
        if value > opt.value * (1 + 1e-9):
            missed.append((inst.family, inst.chunks, inst.profile.num_stages, inst.m, inst.limit_name, obj, value, opt.value))
    assert not missed


@pytest.mark.parametrize("seed", range(6))
def test_its_fast_timing_is_the_core_simulators(seed):
    # the search times candidates with its own ASAP loop on pass ids: it must agree with
    # zbsearch.simulate on every order, deadlocks included (random orders mostly deadlock),
    # split or with some backwards fused (their F at t_ff, the BW at t_bw)
    from zbsearch.simulator import Deadlock
    from zbsearch.solver.local_search import _Model

    inst = _generated(seed)
    if seed % 2:
        inst = with_fused(random.Random(seed), inst)
    rng = random.Random(seed)
    for objective in ("span", "makespan"):
        problem = _problem(inst, objective)
        model = _Model(problem)
        base = sequential_schedule(problem)
        for trial in range(60):
            rows = [list(row) for row in base]
            for row in rows:  # a few swaps: some orders run, some deadlock
                for _ in range(trial % 4):
                    i, j = rng.randrange(len(row)), rng.randrange(len(row))
                    row[i], row[j] = row[j], row[i]
            if seed % 2:  # fuse a random choice of backwards (their W leaves the row)
                fused = {(a.stage, a.mb) for row in rows for a in row if a.op is Op.B and rng.random() < 0.5}
                rows = [[Action(a.stage, Op.BW, a.mb) if a.op is Op.B and (a.stage, a.mb) in fused else a
                         for a in row if not (a.op is Op.W and (a.stage, a.mb) in fused)] for row in rows]
            fused = frozenset((a.stage, a.mb) for row in rows for a in row if a.op is Op.BW)
            ids = [[model.id[(a.stage, Op.B if a.op is Op.BW else a.op, a.mb)] for a in row] for row in rows]
            score = model.score(ids, model.costs((fused, frozenset()))[0])
            try:
                value, tl = problem.evaluate(rows)
            except Deadlock:
                assert score is None
                continue
            assert score is not None and score[0] == pytest.approx(value, abs=1e-9)
            assert score[1] == pytest.approx(sum(tl.span), abs=1e-9)
