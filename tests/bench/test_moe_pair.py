"""bench/moe_pair.py's prefix bound and exact model against exact oracles with pairs.

Generated pipelines of two ranks (one stage each with W passes of their own, or a V whose
backwards hold no W time) with all-to-all a share of 0 to 50% of F and B, links of 0 or 0.1 ms
and, on half, a memory limit (``tests/solver/test_pairing_bound.py``'s instances, those where
split backwards lose nothing against fused ones, as both require): the oracle enumerates every
per-rank order and every choice of pairs and gives each rank's least span. Checked: per rank
and for prefixes of a third, half and all of the rank's least busy time, the prefix bound (with
the other rank's machine, and without) never above that least span, and above the pairing
bound on some; counting the unpaired forwards and backwards of the prefix apart (as if a rank
had not as many of each) is above it on some, which the oracle catches. The CP-SAT model over
every rank finds the oracle's least span. On Vs of 3 or 4 ranks (where a middle rank's machine
matters) that model is the reference: the prefix bound never above it, and a machine that
runs one more round of passes first is caught; at 4 to 8 ranks, never above the spans of
simulated classic schedules.
"""

from __future__ import annotations

import random

import pytest

import bench.moe_pair as moe_pair
from bench.moe_pair import prefix_bound
from tests.solver.oracle import paired_optima, paired_rank_optima
from tests.solver.test_pairing_bound import _instance, _rows
from zbsearch import CostModel, Profile, StageCost, build_classic
from zbsearch.bounds import rank_pairing_span_lower_bounds
from zbsearch.formats.mesh import ProfileMesh
from zbsearch.layout import placement

TOL = 1e-9


def _bounds(cost, m, limit, machines=True) -> list[float]:
    out = []
    for r in range(cost.num_ranks):
        floor = prefix_bound(cost, m, limit, r, 0.0).floor
        out.append(max(prefix_bound(cost, m, limit, r, floor * k, machines=machines).bound for k in (1 / 3, 1 / 2, 1.0)))
    return out


def _cases(count: int, chunks: int, split: bool) -> list:
    """The first ``count`` instances where split backwards lose nothing (what the bound needs)."""
    out, seed = [], 0
    while len(out) < count:
        cost, m, limit = _instance(seed, chunks, split=split)
        if moe_pair._split_dominates(cost):
            out.append((cost, m, limit, split))
        seed += 1
    return out


def _check(cases) -> tuple[int, int]:
    raised = caught = 0
    for cost, m, limit, split in cases:
        best = paired_rank_optima(cost, [_rows(cost, r, m, limit, split) for r in range(2)], limit)
        bound, alone = _bounds(cost, m, limit), _bounds(cost, m, limit, machines=False)
        pairing = rank_pairing_span_lower_bounds(cost, m, limit)
        for r in range(2):
            assert bound[r] <= best[r] * (1 + TOL) + TOL, (cost, limit, r, bound, best)
            assert alone[r] <= best[r] * (1 + TOL) + TOL, (cost, limit, r, alone, best)
            raised += bound[r] > pairing[r] + 1e-6
        original = moe_pair._unpaired
        moe_pair._unpaired = lambda f, b: f + b  # WRONG: a rank's unpaired forwards and backwards apart
        try:
            caught += any(w > o * (1 + 1e-6) for w, o in zip(_bounds(cost, m, limit), best))
        finally:
            moe_pair._unpaired = original
    return raised, caught


def test_prefix_bound_below_each_ranks_least_span_one_stage_per_rank():
    raised, caught = _check(_cases(10, 1, True))
    assert raised >= 2 and caught >= 2


@pytest.mark.slow
def test_prefix_bound_below_each_ranks_least_span_in_a_v():
    raised, caught = _check(_cases(6, 2, False))
    assert raised >= 1 and caught >= 1


def _v(seed: int):
    """A V of 3 or 4 ranks, every stage alike on a grid of 0.25 ms, all-to-all 20 to 50% of F and
    B, links of 0, 0.05 or 0.25 ms, a memory limit of p/2 + 1 to p + 1 activations or none; p or
    p + 1 microbatches."""
    rng = random.Random(seed)
    p = rng.randint(3, 4)
    t_f, t_b, t_w = (round(rng.uniform(lo, 2.0) * 4) / 4 for lo in (0.5, 0.5, 0.25))
    share = rng.choice([0.2, 0.3, 0.4, 0.5])
    st = StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=share * t_f, a_b=share * t_b)
    prof = Profile(name=f"v{seed}", memory_unit="activations", stages=[st] * p, t_comm=rng.choice([0.0, 0.05, 0.25]),
                   mesh=ProfileMesh(pp=p, ep=8))
    limit = None if rng.random() < 0.3 else [rng.randint(p // 2 + 1, p + 1) * 1.0] * p
    return CostModel.from_profile(prof, placement(p, 2, "v")), rng.randint(p, p + 1), limit


def _wrong_releases(cost, m, r, chains):
    """WRONG: another rank's machine as if it ran one more round of its passes first."""
    out = _RELEASES(cost, m, r, chains)
    return {c: [t + cost.t_f[0] + cost.t_b[0] if t > 0 else t for t in ts] for c, ts in out.items()}


_RELEASES = moe_pair._releases


@pytest.mark.slow
def test_prefix_bound_below_the_exact_optimum_of_a_v_of_three_or_four_ranks():
    """Against ``moe_pair.solve`` over every rank (the exact idle relaxation, checked against the
    oracle above): the largest prefix bound never above its least largest span."""
    raised = caught = checked = 0
    for seed in range(12):
        cost, m, limit = _v(seed)
        if not moe_pair._split_dominates(cost):
            continue
        exact = moe_pair.solve(cost, m, limit, list(range(cost.num_ranks)), time_limit=20)
        if exact.status != "OPTIMAL":
            continue
        checked += 1
        bound = _bounds(cost, m, limit)
        assert max(bound) <= exact.value * (1 + TOL) + TOL, (seed, bound, exact.value)
        raised += max(bound) > max(rank_pairing_span_lower_bounds(cost, m, limit)) + 1e-6
        moe_pair._releases = _wrong_releases
        try:
            caught += max(_bounds(cost, m, limit)) > exact.value * (1 + 1e-6)
        finally:
            moe_pair._releases = _RELEASES
    assert checked >= 6 and raised >= 2 and caught >= 1, (checked, raised, caught)


def test_exact_model_is_the_oracles_optimum():
    """``moe_pair.solve`` over every rank against the oracle's least span: never above it (a
    relaxation: the idle model) and, on these, equal (pairs, memory and links modelled exactly)."""
    equal = 0
    cases = _cases(6, 1, True)
    for cost, m, limit, split in cases:
        best = paired_optima(cost, [_rows(cost, r, m, limit, split) for r in range(2)], limit)["span"]
        exact = moe_pair.solve(cost, m, limit, [0, 1], time_limit=20)
        assert exact.status == "OPTIMAL" and exact.value is not None
        assert exact.bound <= best * (1 + TOL) + TOL and exact.value <= best * (1 + TOL) + TOL, (cost, limit, exact, best)
        equal += abs(exact.value - best) <= 1e-6
    assert equal >= len(cases) - 1


@pytest.mark.slow
def test_prefix_bound_below_the_spans_of_classic_schedules_at_scale():
    """At the sizes where another rank's machine matters (a V of 4 to 8 ranks, 2p microbatches),
    per rank the prefix bound without a memory limit never above that rank's span in
    DualPipeV (its pairs overlapped, and not) or ZB-V, simulated."""
    rng = random.Random(7)
    for _ in range(6):
        p = rng.choice([4, 6, 8])
        t_f, t_b, t_w = (round(rng.uniform(lo, 2.0) * 4) / 4 for lo in (0.5, 0.5, 0.25))
        share = rng.choice([0.2, 0.3, 0.4])
        st = StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=share * t_f, a_b=share * t_b)
        prof = Profile(name="scale", memory_unit="activations", stages=[st] * p, t_comm=rng.choice([0.0, 0.05]),
                       mesh=ProfileMesh(pp=p, ep=8))
        cost, m = CostModel.from_profile(prof, placement(p, 2, "v")), 2 * p
        if not moe_pair._split_dominates(cost):
            continue
        spans = [build_classic("dualpipe-v", prof, m).predicted.span, build_classic("zb-v", prof, m).predicted.span,
                 build_classic("dualpipe-v", prof, m, overlap=False).predicted.span]
        for r in range(p):
            res = prefix_bound(cost, m, None, r, min(2.5 * p * t_f, prefix_bound(cost, m, None, r, 0.0).floor), max_nodes=20_000)
            assert all(res.bound <= s[r] * (1 + TOL) + TOL for s in spans), (p, r, res.bound, [s[r] for s in spans])
