"""bench/moe_ramp.py's one-rank schedules against the pairing bound, past the exact oracle's sizes.

Generated V pipelines of 3 to 5 ranks (every stage alike, all-to-all a share of 10 to 50% of F
and B, links of 0 or 0.05 ms, a memory limit of p/2 + 1 to p + 1 activations or none), 2p to
2p + 2 microbatches. A one-rank schedule, checked pass by pass, is one of the relaxation's where
the rank is the only machine, whose optimum the pairing bound (which reasons from that rank and
the dependency paths alone) never exceeds: checked per rank, the bound never above the best of
a few such schedules; charging each stage's last backward on top of the warm-up's (the wrong
variant of tests/solver/test_pairing_bound.py) is above it on some rank.
"""

from __future__ import annotations

import math
import random

from bench.moe_ramp import _check, _lags, _schedule
from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import Op
from zbsearch.bounds import rank_pairing_span_lower_bounds
from zbsearch.formats.mesh import ProfileMesh
from zbsearch.layout import placement

TOL = 1e-9


def _instance(seed: int) -> tuple[CostModel, int, float | None]:
    rng = random.Random(seed)
    p = rng.randint(3, 5)
    t_f, t_b, t_w = (round(rng.uniform(lo, 2.5) * 8) / 8 for lo in (1.0, 1.0, 0.5))
    share = rng.uniform(0.1, 0.5)
    st = StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=share * t_f, a_b=share * t_b)
    prof = Profile(name=f"ramp{seed}", memory_unit="activations", stages=[st] * p, t_comm=rng.choice([0.0, 0.05]),
                   mesh=ProfileMesh(pp=p, ep=8))
    limit = None if rng.random() < 0.25 else rng.randint(p // 2 + 1, p + 1) * 1.0
    return CostModel.from_profile(prof, placement(p, 2, "v")), rng.randint(2 * p, 2 * p + 2), limit


def _best(cost: CostModel, r: int, m: int, limit: float | None, tries: int) -> float:
    lag, rng, cap = _lags(cost, r), random.Random(r), math.inf if limit is None else limit
    return min(_check(cost, r, m, cap, _schedule(cost, r, m, cap, lag, rng)) for _ in range(tries))


def test_pairing_bound_never_above_a_one_rank_schedule():
    caught = 0
    for seed in range(12):
        cost, m, limit = _instance(seed)
        p = cost.num_ranks
        bound = rank_pairing_span_lower_bounds(cost, m, None if limit is None else [limit] * p)
        wrong = 2 * (cost.hideable(0, Op.F) + cost.hideable(0, Op.B))  # each stage's last backward, and its forward
        for r in (0, p // 2, p - 1):
            best = _best(cost, r, m, limit, 12)
            assert bound[r] <= best * (1 + TOL), (seed, r, bound[r], best)
            caught += bound[r] + wrong > best * (1 + 1e-6)
    assert caught >= 5
