"""The deferral bound (``rank_deferral_span_lower_bounds``) against the exact oracle.

Ranks whose B frees little of what F allocated: memory caps how many W a rank can
leave for after its last B, so the bound rises above the memory-blind ones. It must stay at or
below the exact optimum over every order, fused or split backward and choice of recomputation.
"""

from __future__ import annotations

import random

import pytest

from zbsearch import Profile, StageCost
from zbsearch.bounds import (
    memory_span_lower_bound,
    rank_deferral_span_lower_bounds,
    rank_span_lower_bounds,
)

from .harness import TOL
from .oracle import Instance, cp_optimum_many

pytestmark = pytest.mark.slow

_G = 1 / 16


def _instance(seed: int) -> Instance:
    """Two stages, W freeing most of the activations (so that few W can wait), with
    recomputation (full, and selective on some) and a cheaper fused backward on some stages,
    and a limit of one to one and a half microbatches per rank."""
    rng = random.Random(seed)
    p, m = 2, 3
    stages = []
    for _ in range(p):
        m_w = rng.randint(16, 31) / 32
        extra: dict = {}
        if rng.random() < 0.7:
            extra = {"t_r": rng.randint(2, 16) * _G, "m_fc": rng.randint(1, 8) / 32}
            if rng.random() < 0.5:
                extra.update(t_rs=rng.randint(1, 4) * _G, m_fs=rng.randint(16, 31) / 32)
        if rng.random() < 0.3:
            extra["t_bw"] = rng.randint(8, 40) * _G
        stages.append(StageCost(t_f=rng.randint(4, 12) * _G, t_b=rng.randint(4, 12) * _G, t_w=rng.randint(4, 16) * _G,
                                m_f=1.0, m_b=-(1 - m_w), m_w=-m_w, **extra))
    prof = Profile(name=f"deferral-p{p}", memory_unit="activations", stages=stages,
                   t_comm=[rng.randint(0, 8) * _G for _ in range(p - 1)])
    x = rng.choice([1.0, 1.25, 1.5])
    return Instance("deferral", prof, m, 1, [x] * p, f"{x} M_B")


def test_deferral_bound_never_exceeds_the_optimum():
    cases = [_instance(seed) for seed in (0, 2, 3, 5, 6, 7, 8, 9)]  # CP-SAT proves these in seconds
    jobs = [(i.cost, i.m, i.limit, "span", {"recompute": i.cost.can_recompute, "fused": i.cost.fusing_may_pay()})
            for i in cases]
    results = cp_optimum_many(jobs, time_limit=30, processes=2)
    raised = tight = 0
    for k, (inst, res) in enumerate(zip(cases, results)):
        assert res.optimal
        deferral = max(rank_deferral_span_lower_bounds(inst.cost, inst.m, inst.limit))
        assert deferral <= res.value * (1 + TOL), (k, deferral, res.value)
        assert memory_span_lower_bound(inst.cost, inst.m, inst.limit) <= res.value * (1 + TOL)
        raised += deferral > max(rank_span_lower_bounds(inst.cost, inst.m)) * (1 + TOL)
        tight += deferral >= res.value * (1 - TOL)
    assert raised  # the sample exercises the memory the bound counts
    assert tight  # and the bound is the optimum on some


def test_deferral_bound_is_the_memory_blind_one_without_a_limit_that_binds():
    """With room for every W to wait, the bound counts F and B only: never above the
    memory-blind one-machine bound, which counts those too."""
    for seed in range(20):
        inst = _instance(seed)
        free = [1e9] * len(inst.limit)
        assert max(rank_deferral_span_lower_bounds(inst.cost, inst.m, free)) <= \
            max(rank_span_lower_bounds(inst.cost, inst.m)) * (1 + TOL)


def test_a_split_backwards_hold_caps_the_deferred_w_where_fusing_or_recomputing_is_offered():
    """Where a fused backward may be cheaper or a forward cheaper checkpointed, the bounds' costs
    (``for_bounds``) free all memory at B, as a fused BW does; a W still pending is a split
    backward's, whose microbatch holds what its B leaves. The bound that counts that rises
    above the one on the fused memory alone, and stays at or below the exact optimum."""
    cases = [_instance(seed) for seed in (7, 12, 24, 36)]
    jobs = [(i.cost, i.m, i.limit, "span", {"recompute": i.cost.can_recompute, "fused": i.cost.fusing_may_pay()})
            for i in cases]
    for inst, res in zip(cases, cp_optimum_many(jobs, time_limit=30, processes=2)):
        assert res.optimal
        split = max(rank_deferral_span_lower_bounds(inst.cost, inst.m, inst.limit))
        fused = max(rank_deferral_span_lower_bounds(inst.cost.for_bounds(), inst.m, inst.limit))
        assert fused < split <= res.value * (1 + TOL), (inst.limit, fused, split, res.value)
