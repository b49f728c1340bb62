"""The relay bound (``rank_relay_span_lower_bounds``): what another rank's memory makes a rank wait for.

Generated pipelines whose ranks hold one or two microbatches whole at once, W freeing most of
a microbatch's memory, with recomputation and a cheaper fused backward on some stages: a rank
then waits for the core of a later rank (its first forward to its last B), whose memory spaces
the backwards it sends back. Judged against schedules the solver finds (every rank's span, as
the simulator times it) and against the exact oracle (CP-SAT over every order, fused or split
backward and choice of recomputation), with a deliberately wrong variant that must be caught.
"""

from __future__ import annotations

import random

import pytest

import zbsearch.bounds as bounds
from zbsearch import Profile, StageCost, simulate
from zbsearch.bounds import memory_span_lower_bound, rank_relay_span_lower_bounds
from zbsearch.solver import solve

from .harness import TOL
from .oracle import Instance, cp_optimum_many

_G = 1 / 16


def _instance(seed: int) -> Instance:
    """Two or three ranks (one stage each, m = 3; or two ranks in a V, m = 2), times on a 1/16 grid,
    W freeing most of what F allocates, recomputation on most stages, a cheaper fused backward
    on some, and a limit of 1 to 1.9 microbatches (of a profile stage) per rank."""
    rng = random.Random(seed)
    chunks = 2 if seed % 5 == 4 else 1
    ranks = 2 if chunks == 2 else rng.choice([2, 3, 3])
    stages = []
    for _ in range(ranks):  # the V splits each in two (the oracle's ``Instance``)
        m_b = -rng.randint(0, 12) / 32
        extra: dict = {}
        if rng.random() < 0.8:
            extra = {"t_r": rng.randint(3, 10) * _G, "m_fc": rng.randint(0, 4) / 32}
        if rng.random() < 0.3:
            extra["t_bw"] = rng.randint(12, 40) * _G
        stages.append(StageCost(t_f=rng.randint(4, 10) * _G, t_b=rng.randint(4, 16) * _G, t_w=rng.randint(4, 16) * _G,
                                m_f=1.0, m_b=m_b, m_w=-(1 + m_b), **extra))
    prof = Profile(name=f"relay-{ranks}x{chunks}", memory_unit="activations", stages=stages, t_comm=rng.randint(0, 2) * _G)
    limit = [rng.randint(32, 60) / 32 for _ in range(ranks)]
    return Instance("relay", prof, 3 if chunks == 1 else 2, chunks, limit, "1-1.9 M_B")


def _raised(inst: Instance) -> bool:
    """Whether the relay bound is above every other bound of the solver's on this instance."""
    relay = max(rank_relay_span_lower_bounds(inst.cost, inst.m, inst.limit))
    return relay > _without_relay(inst) * (1 + TOL)


def _without_relay(inst: Instance) -> float:
    original = bounds.rank_relay_span_lower_bounds
    bounds.rank_relay_span_lower_bounds = lambda cost, m, limit, **kw: [0.0] * cost.num_ranks  # type: ignore[assignment]
    try:
        return memory_span_lower_bound(inst.cost, inst.m, inst.limit)
    finally:
        bounds.rank_relay_span_lower_bounds = original


def test_relay_bound_is_below_every_ranks_span_in_solved_schedules():
    """Per rank, never above that rank's span in a schedule the solver finds (simulated), and
    the solver's full bound takes it: on this family it raises that bound on several instances."""
    raised = 0
    for seed in range(8):
        inst = _instance(seed)
        relay = rank_relay_span_lower_bounds(inst.cost, inst.m, inst.limit)
        recompute = "auto" if inst.cost.can_recompute else "none"
        res = solve(inst.profile, inst.m, inst.limit, chunks=inst.chunks, time_limit=0.3, milp=False, recompute=recompute)
        spans = simulate(res.schedule.rank_actions, inst.cost).span
        assert all(b <= s * (1 + TOL) for b, s in zip(relay, spans)), (seed, relay, spans)
        assert memory_span_lower_bound(inst.cost, inst.m, inst.limit) >= max(relay) * (1 - TOL)  # the solver's full bound
        raised += _raised(inst)
    assert raised >= 2


@pytest.mark.slow
def test_relay_bound_never_exceeds_the_optimum_and_a_wrong_variant_is_caught():
    """On instances where it is above every other bound: at or below the exact optimum, equal to
    it on some. Counting every W of the later rank in its core (as if memory let none wait
    for after its last B) is wrong, and the oracle catches it."""
    cases = [_instance(seed) for seed in (0, 1, 9, 14, 33, 35)]  # CP-SAT proves these in seconds
    assert all(map(_raised, cases))
    results = cp_optimum_many([(i.cost, i.m, i.limit, "span", {"recompute": True, "fused": i.cost.fusing_may_pay()})
                               for i in cases], time_limit=30, processes=2)
    original = bounds._deferred_work
    try:
        bounds._deferred_work = lambda *a: 0.0  # type: ignore[assignment]
        wrong = [max(rank_relay_span_lower_bounds(i.cost, i.m, i.limit)) for i in cases]
    finally:
        bounds._deferred_work = original
    tight = caught = 0
    for inst, res, bad in zip(cases, results, wrong):
        assert res.optimal
        relay = max(rank_relay_span_lower_bounds(inst.cost, inst.m, inst.limit))
        assert relay <= res.value * (1 + TOL), (inst.profile.name, inst.limit, relay, res.value)
        assert memory_span_lower_bound(inst.cost, inst.m, inst.limit) >= relay * (1 - TOL)
        tight += relay >= res.value * (1 - TOL)
        caught += bad > res.value * (1 + TOL)
    assert tight >= 2 and caught >= 2


@pytest.mark.slow
def test_relay_bound_of_each_rank_never_exceeds_that_ranks_least_span():
    """Per rank (the makespan and iteration bounds build on each rank's): at or below the least
    span of that rank over every schedule, in the idle relaxation every bound holds for."""
    cases = [_instance(seed) for seed in (0, 9)]  # three ranks in a line, two in a V
    assert all(map(_raised, cases))
    jobs, bounds_of = [], []
    for inst in cases:
        relay = rank_relay_span_lower_bounds(inst.cost, inst.m, inst.limit)
        for r, b in enumerate(relay):
            jobs.append((inst.cost, inst.m, inst.limit, "span", {"recompute": True, "fused": inst.cost.fusing_may_pay(),
                                                                  "rank": r, "semantics": "idle"}))
            bounds_of.append(b)
    for b, res in zip(bounds_of, cp_optimum_many(jobs, time_limit=30, processes=2)):
        assert res.optimal
        assert b <= res.value * (1 + TOL), (b, res.value)
