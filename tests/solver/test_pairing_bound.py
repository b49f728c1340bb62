"""The pairing bound (``rank_pairing_span_lower_bounds``) against an exact oracle with pairs.

Generated pipelines of two ranks (one stage each, fused or split, or a V) with all-to-all a
share of 0 to 50% of F and B (on some, a share of what pairs hide left exposed), links of 0 or
0.1 ms and, on half, a memory limit of one or two microbatches per stage (in a V, of 2 to 8
forwards): the oracle enumerates every per-rank order and every choice of pairs
(``paired_rank_optima``) and gives each rank's least span. Checked: per rank, the bound (and
the solver's, which takes it) never above that rank's least span, never below the window's
fractional loss it replaces, and above it and above itself without the limit on some ranks;
counting the backwards after a rank's last forward on top of the warm-up's (as if the
backwards a warm-up forward leaves without a partner could not be those) is wrong, and the
oracle catches it.
"""

from __future__ import annotations

import random

import pytest

import zbsearch.bounds as bounds
from tests.helpers.reference import rank_orders
from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import Action, Op
from zbsearch.bounds import rank_pairing_span_lower_bounds
from zbsearch.layout import placement

from .oracle import paired_rank_optima

TOL = 1e-9


def _instance(seed: int, chunks: int, split: bool = False) -> tuple[CostModel, int, list[float] | None]:
    """Two ranks; m = 2. W takes no time and frees nothing unless ``split`` (then the oracle
    orders W passes too), so a fused backward times and holds as a split one."""
    rng = random.Random(seed)
    stages = []
    for _ in range(2):
        t_f, t_b = round(rng.uniform(0.3, 2.0), 2), round(rng.uniform(0.5, 2.5), 2)
        t_w = round(rng.uniform(0.2, 1.5), 2) if split else 0.0
        m_w = -0.5 if split else 0.0
        stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=t_w, t_bw=t_b + t_w, m_f=1.0, m_b=-1.0 - m_w, m_w=m_w,
                                a_f=round(t_f * rng.uniform(0.0, 0.5), 3), a_b=round(t_b * rng.uniform(0.0, 0.5), 3),
                                pair_exposed=round(rng.uniform(0.1, 0.6), 2) if rng.random() < 0.3 else None))
    prof = Profile(name=f"pairing{seed}", memory_unit="activations", stages=stages, t_comm=rng.choice([0.0, 0.1]))
    limit = None if rng.random() < 0.5 else [rng.choice([1.0, 2.0] if chunks == 1 else [1.0, 1.5, 2.0, 4.0])] * 2
    return CostModel.from_profile(prof, placement(2, chunks, "v")), 2, limit


def _rows(cost: CostModel, r: int, m: int, limit: list[float] | None, split: bool) -> list[list[Action]]:
    rows = rank_orders(cost, r, m, ops=(Op.F, Op.B, Op.W) if split else (Op.F, Op.B), fuse=not split)
    if limit is None:
        return rows
    out = []
    for row in rows:
        held, peak = 0.0, 0.0
        for a in row:
            held += cost.memory(a.stage, a.op)
            peak = max(peak, held)
        if peak <= limit[r] + TOL:
            out.append(row)
    return out


def _fractional(cost: CostModel, m: int) -> list[float]:
    """The bound with the window's loss at its fractional relaxation, without memory."""
    original = bounds._warm_up_loss
    bounds._warm_up_loss = lambda c, stages, window, m, budget: original(c, stages + stages + stages, window, m, None)  # type: ignore[assignment]
    try:
        return rank_pairing_span_lower_bounds(cost, m)
    finally:
        bounds._warm_up_loss = original


def _cool_down_added(cost: CostModel, m: int, limit: list[float] | None) -> list[float]:
    """WRONG: each of the rank's stages' last backward, after its last forward, charged apart
    from the warm-up's backwards."""
    original = bounds._warm_up_loss

    def wrong(c, stages, window, m, budget):
        least_b = min(c.hideable(s, Op.B) for s in stages)
        return original(c, stages, window, m, budget) + len(stages) * (min(c.hideable(s, Op.F) for s in stages) + least_b)

    bounds._warm_up_loss = wrong  # type: ignore[assignment]
    try:
        return rank_pairing_span_lower_bounds(cost, m, limit)
    finally:
        bounds._warm_up_loss = original


def _check(cases) -> tuple[int, int, int]:
    """Over ``cases``: the ranks whose bound is above its fractional relaxation and above itself
    without the memory limit, and the instances where the wrong variant is above some rank's
    least span."""
    raised = capped = caught = 0
    for cost, m, limit, split in cases:
        best = paired_rank_optima(cost, [_rows(cost, r, m, limit, split) for r in range(2)], limit)
        bound = rank_pairing_span_lower_bounds(cost, m, limit)
        for r, (b, f, o) in enumerate(zip(bound, _fractional(cost, m), best)):
            assert f <= b + TOL and b <= o * (1 + TOL) + TOL, (cost, limit, r, b, f, o)
            raised += b > f + 1e-6
            capped += b > rank_pairing_span_lower_bounds(cost, m)[r] + 1e-6
        assert all(a <= o * (1 + TOL) + TOL for a, o in zip(bounds._rank_bounds(cost, m, limit), best))  # the solver's
        caught += any(w > o * (1 + 1e-6) for w, o in zip(_cool_down_added(cost, m, limit), best))
    return raised, capped, caught


def test_pairing_bound_below_each_ranks_least_span_one_stage_per_rank():
    cases = [(*_instance(seed, 1), False) for seed in range(24)] + [(*_instance(seed, 1, split=True), True) for seed in range(6)]
    raised, capped, caught = _check(cases)
    assert raised >= 3 and capped >= 3 and caught >= 3


@pytest.mark.slow
def test_pairing_bound_below_each_ranks_least_span_in_a_v():
    raised, capped, caught = _check([(*_instance(seed, 2), False) for seed in range(6)])
    assert raised >= 2 and capped >= 1 and caught >= 1
