"""The bound over every cut at once (``relaxation.relaxed_bound``) against enumeration.

Its dynamic program must find the least over every cut of the per-rank bounds it adds up (each
cut's bound computed directly), which must never exceed the exact optimum of any cut (every
per-rank order, fused or split backwards and recomputation choice simulated, on tiny models);
nor may each cut's own bound (``Cuts.evaluate``'s key), which takes these per-rank bounds too.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

import zbsearch as zb
from tests.helpers.layers import random_layers
from tests.solver.oracle import brute_force
from zbsearch.planner import Cut, stage_profile
from zbsearch.planner.compose import activation_need, static_bytes
from zbsearch.planner.relaxation import RankBounds, rank_pieces, relaxed_bound, work_bound
from zbsearch.planner.search import Cuts, compositions
from zbsearch.solver.problem import Problem


def _instance(seed: int, units: tuple[int, int] = (4, 9)):
    """Random units (with recomputation costs), a placement and rank count, m, a budget (None,
    or between the least and the most static memory of a cut plus a few layers' activations)
    and a recomputation mode."""
    rng = random.Random(seed)
    placement = rng.choice(["one", "v"])
    ranks = rng.choice([2, 3]) if placement == "one" else 2
    stages = ranks * (2 if placement == "v" else 1)
    L = random_layers(seed, rng.randint(max(units[0], stages) - 2, units[1] - 2), head=rng.uniform(1, 6),
                      recompute=rng.choice(["full", "both"]), comm=rng.choice([0.0, 0.05, 0.5]))
    m = rng.randint(2, 6)
    budget = None
    if rng.random() < 0.7:
        statics = [max(static_bytes(L, Cut(c, placement), "adamw")) for c in compositions(L.num_units, stages)]
        budget = rng.uniform(min(statics), max(statics)) + rng.uniform(1.0, 4.0) * 1e6
    recompute = rng.choice(["none", "none", "auto", "full"])
    return L, ranks, placement, m, budget, recompute


def _fits(L, cut, budget, recompute) -> bool:
    if budget is None:
        return True
    limit = [budget - s for s in static_bytes(L, cut, "adamw")]
    return all(x > 0 and n <= x * (1 + 1e-9) for n, x in zip(activation_need(L, cut, recompute), limit))


@pytest.mark.parametrize("seed", range(40))
def test_the_program_finds_the_least_over_every_cut(seed):
    L, ranks, placement, m, budget, recompute = _instance(seed)
    objective = ("span", "makespan")[seed % 2]
    ranked = RankBounds(L, ranks, placement, m, recompute, budget, "adamw", None, objective)
    stages = ranks * (2 if placement == "v" else 1)
    space = Cuts(L, ranks, placement, m, budget, "adamw", "span", recompute)
    direct = math.inf
    for counts in compositions(L.num_units, stages):
        value = ranked.cut_value(counts)
        assert math.isfinite(value) == space.evaluate(counts).feasible  # the same cuts fit the budget
        direct = min(direct, value)
    got = relaxed_bound(L, ranks, placement, m, recompute, budget=budget, optimizer="adamw", objective=objective)
    assert got == pytest.approx(direct, rel=1e-12) or (got == direct == math.inf)


@pytest.mark.slow  # brute force over every schedule: seconds each
@pytest.mark.parametrize("seed", range(12))
def test_the_bound_is_below_every_cuts_exact_optimum(seed):
    """Tiny models (2 ranks, one stage each or a V, m of 1 or 2): every cut's optimum span and
    makespan over every schedule, by brute force."""
    rng = random.Random(1000 + seed)
    placement = "one" if seed % 3 else "v"
    recompute = rng.choice(["none", "auto"])  # brute force cannot require every microbatch recomputed ("full")
    L = random_layers(seed, 2, head=rng.uniform(1, 5),
                      recompute="full", comm=rng.choice([0.0, 0.3]))
    m = 1 if placement == "v" or recompute == "auto" else 2
    stages = 2 * (2 if placement == "v" else 1)
    statics = [max(static_bytes(L, Cut(c, placement), "adamw")) for c in compositions(L.num_units, stages)]
    budget = rng.choice([None, max(statics) + rng.uniform(1.2, 3.0) * 1e6])
    space = Cuts(L, 2, placement, m, budget, "adamw", "span", recompute)
    best = makespan = math.inf
    for counts in compositions(L.num_units, stages):
        cut = Cut(counts, placement)
        if not _fits(L, cut, budget, recompute):
            continue
        limit = None if budget is None else [budget - s for s in static_bytes(L, cut, "adamw")]
        cost = Problem.make(zb.CostModel.from_profile(stage_profile(L, cut), cut.stage_to_rank), m,
                            recompute=recompute).cost  # type: ignore[arg-type]
        value, _ = brute_force(cost, m, limit, "span", fused=True, recompute=recompute != "none",
                               max_combinations=500_000)
        assert space.evaluate(counts).key <= value * (1 + 1e-9)  # each cut's own bound, these folded in
        best = min(best, value)
        makespan = min(makespan, brute_force(cost, m, limit, "makespan", fused=True, recompute=recompute != "none",
                                             max_combinations=500_000)[0])
    assert best < math.inf
    assert relaxed_bound(L, 2, placement, m, recompute, budget=budget) <= best * (1 + 1e-9)
    assert relaxed_bound(L, 2, placement, m, recompute, budget=budget, objective="makespan") <= makespan * (1 + 1e-9)


def test_a_deadline_falls_back_to_the_busiest_ranks_work():
    L = random_layers(3, 12)
    for placement in ("one", "v"):
        late = relaxed_bound(L, 3, placement, 8, deadline=0.0)
        assert late == work_bound(L, 3, placement, 8)
        assert late <= relaxed_bound(L, 3, placement, 8) * (1 + 1e-12)


def test_the_v_bound_takes_both_pieces_of_each_rank():
    """The V's pieces pair up on a rank (piece r with piece 2P-1-r): units so uneven that no
    pairing reaches the mean over ranks, which the busiest rank's work alone would give."""
    L = random_layers(8, 6)
    w = RankBounds(L, 2, "v", 4, "none", None, "adamw", None).w
    best = min(max(sum(w[lo:hi]) + sum(w[c:d]) for (lo, hi), (c, d) in rank_pieces(counts, "v"))
               for counts in compositions(L.num_units, 4))
    assert relaxed_bound(L, 2, "v", 4) >= 4 * best * (1 - 1e-12)
    assert 4 * best > 4 * max(sum(w) / 2, w[0] + w[-1], max(w)) * (1 + 1e-6)
    assert list(itertools.chain(*rank_pieces((1, 2, 2, 3), "v"))) == [(0, 1), (5, 8), (1, 3), (3, 5)]


@pytest.mark.slow  # plans, and brute force over every schedule of every cut
@pytest.mark.parametrize("seed", range(8))
def test_the_plans_bound_never_exceeds_the_best_cuts_exact_optimum(seed, monkeypatch):
    """Tiny models, every cut solved exactly by brute force: the plan's bound is never above the
    best of them and its value never below, whether it priced every cut or bounded them all at
    once (``ENUMERATE`` 0: no placement is priced cut by cut)."""
    import importlib

    from zbsearch.planner import plan

    plan_module = importlib.import_module("zbsearch.planner.plan")

    rng = random.Random(2000 + seed)
    placement = ("one", "v")[seed % 2]
    recompute = ("none", "auto")[seed // 2 % 2]
    objective = ("span", "makespan")[seed // 4 % 2]
    m = 1 if placement == "v" or recompute == "auto" else 2
    L = random_layers(seed, 2, head=rng.uniform(1, 5), recompute="full", comm=rng.choice([0.0, 0.3]))
    stages = 2 * (2 if placement == "v" else 1)
    # every cut fits, some only just
    needs = [max(s + n for s, n in zip(static_bytes(L, Cut(c, placement), "adamw"), activation_need(L, Cut(c, placement))))
             for c in compositions(L.num_units, stages)]
    budget = max(needs) * rng.uniform(1.0, 1.3)
    best = math.inf
    for counts in compositions(L.num_units, stages):
        cut = Cut(counts, placement)
        if _fits(L, cut, budget, recompute):
            limit = [budget - s for s in static_bytes(L, cut, "adamw")]
            cost = Problem.make(zb.CostModel.from_profile(stage_profile(L, cut), cut.stage_to_rank), m,
                                recompute=recompute).cost  # type: ignore[arg-type]
            best = min(best, brute_force(cost, m, limit, objective, fused=True, recompute=recompute != "none",
                                         max_combinations=500_000)[0])
    for enumerate_up_to in (plan_module.ENUMERATE, 0):
        monkeypatch.setattr(plan_module, "ENUMERATE", enumerate_up_to)
        part = plan(L, 2, m, budget, placement=placement, time_limit=1.5, objective=objective,
                    recompute=recompute).partition
        assert part.exhaustive == (enumerate_up_to > 0)
        assert part.lower_bound <= best * (1 + 1e-9)
        assert part.value >= best * (1 - 1e-9)


@pytest.mark.slow  # the solver on every cut
@pytest.mark.parametrize("seed", range(4))
def test_with_full_recomputation_the_bound_is_below_every_cuts_schedule(seed):
    """Every microbatch recomputed (which brute force cannot require): the bound counts each
    forward with its recompute pass, so it must stay below the schedule the solver finds for
    every cut, recomputing every forward."""
    L, ranks, placement, m, budget, _ = _instance(100 + seed, units=(5, 7))
    stages = ranks * (2 if placement == "v" else 1)
    if not any(_fits(L, Cut(c, placement), budget, "full") for c in compositions(L.num_units, stages)):
        budget = None
    bound = relaxed_bound(L, ranks, placement, m, "full", budget=budget)
    values = []
    for counts in compositions(L.num_units, stages):
        cut = Cut(counts, placement)
        if _fits(L, cut, budget, "full"):
            limit = None if budget is None else [budget - s for s in static_bytes(L, cut, "adamw")]
            res = zb.solve(stage_profile(L, cut), m, limit, chunks=cut.chunks, time_limit=0.2, milp=False,
                           recompute="full")
            assert res.info.recomputed == m * stages
            values.append(res.info.value)
    assert values and bound <= min(values) * (1 + 1e-9)


@pytest.mark.parametrize("recompute", ["none", "auto"])  # (with "full" the program still offers plain forwards)
def test_the_area_over_every_cut_is_below_each_cuts_area_program(recompute):
    """The relaxation's area term (``RankBounds.area``: its LP over every choice of ways, on the
    units' least costs and the path after each stage's forward) is below the area bound each cut
    proves on its own composed costs (``rank_area_span_lower_bounds``, itself checked against
    exact optima), rank by rank, on generated deep pipelines and tight budgets; and it binds: it
    is above the rank's work on many of them."""
    from zbsearch.bounds import rank_area_span_lower_bounds
    from zbsearch.limits import allowance

    rng = random.Random(len(recompute))
    above = checked = 0
    for trial in range(24):
        placement = ("one", "v")[trial % 2]
        ranks = rng.choice([6, 8]) if placement == "one" else rng.choice([3, 4])
        stages = ranks * (2 if placement == "v" else 1)
        L = random_layers(trial, stages + rng.randint(-2, 0), head=rng.uniform(1, 4), recompute=rng.choice(["full", "both"]),
                          comm=rng.choice([0.0, 0.2]))
        m = rng.randint(4, 12)
        counts = next(c for c in compositions(L.num_units, stages) if rng.random() < 0.3 or c[-1] == 1)
        cut = Cut(counts, placement)
        static = static_bytes(L, cut, "adamw")
        need = activation_need(L, cut, recompute)
        budget = max(s + n for s, n in zip(static, need)) + rng.uniform(0.0, 0.5) * 1e6
        ranked = RankBounds(L, ranks, placement, m, recompute, budget, "adamw")
        cost = Problem.make(zb.CostModel.from_profile(stage_profile(L, cut), cut.stage_to_rank), m,
                            recompute=recompute).cost  # type: ignore[arg-type]
        proved = rank_area_span_lower_bounds(cost, m, [budget - s for s in static])
        for r, ps in enumerate(rank_pieces(counts, placement)):
            busy = m * sum(ranked.pre_w[hi] - ranked.pre_w[lo] for lo, hi in ps)
            area = ranked.area(ps, r, busy, allowance(ranked.limit(ps)))
            assert area <= proved[r] * (1 + 2e-6), (trial, r, area, proved[r])  # (the program keeps a 1e-6 margin)
            checked += 1
            above += area > busy * (1 + 1e-6)
    assert checked >= 48 and above >= 8, (checked, above)
