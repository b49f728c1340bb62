"""The local search fuses a backward where it pays only inside an overlapped pair, against enumeration.

Instances: one rank holding two stages (as the top rank of a V does), m = 2, within a memory
limit, with all-to-all in F and B and a BW that costs exactly B + W (and an F no cheaper before
it): fusing saves nothing alone (``CostModel.fuse_saves`` is false), but a BW paired with a
forward hides more of that forward's all-to-all than its B does (``fuse_pays_in_pair``). The
oracle enumerates every order of the rank's passes with every subset of fused backwards, every
set of pairs on each, within the limit, and simulates each. Checked: the optimum over split,
fused and mixed schedules is below the optimum over split ones on most instances (a search that
never fuses where fusing saves nothing alone cannot reach it), and the local search reaches it,
never below, with a valid schedule.
"""

from __future__ import annotations

import itertools
import random

from zbsearch import CostModel, Profile, StageCost, find_problem
from zbsearch.actions import Action, Op
from zbsearch.formats.schedule import Schedule
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.local_search import local_search_paired
from zbsearch.solver.problem import Problem

from .oracle import _rank_orders, paired_optima

TOL = 1e-9


def _instance(seed: int) -> tuple[Profile, CostModel, int, tuple[float]]:
    rng = random.Random(seed)
    stages = []
    for _ in range(2):
        t_f, t_b, t_w = round(rng.uniform(1.5, 2.5), 2), round(rng.uniform(0.4, 0.8), 2), round(rng.uniform(0.3, 3.0), 2)
        stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0, m_b=-0.5, m_w=-0.5,
                                a_f=round(t_f * rng.uniform(0.3, 0.8), 3), a_b=round(t_b * 0.5, 3)))
    prof = Profile(name=f"moe-one-rank{seed}", memory_unit="activations", stages=stages, t_comm=rng.choice([0.0, 0.1]))
    return prof, CostModel.from_profile(prof, [0, 0]), 2, (rng.choice([2.0, 2.5]),)


def _rows(cost: CostModel, m: int, limit: float, fuse: bool) -> list[list[Action]]:
    """Every order of the rank's passes within ``limit``, with (``fuse``) every subset of its
    backwards fused (a fused one's W dropped) or none."""
    mine = [(s, j) for s in range(cost.num_stages) for j in range(m)]
    subsets = itertools.product((False, True), repeat=len(mine)) if fuse else [(False,) * len(mine)]
    return [row for bits in subsets for row in _rank_orders(cost, m, 0, limit, frozenset(k for k, f in zip(mine, bits) if f))]


def test_the_search_fuses_where_a_bw_pays_only_in_a_pair():
    fused_pays = reached = 0
    seeds = range(10)
    for seed in seeds:
        prof, cost, m, limit = _instance(seed)
        assert not any(cost.fuse_saves(s) for s in range(2)) and all(cost.fuse_pays_in_pair(s) for s in range(2))
        best = paired_optima(cost, [_rows(cost, m, limit[0], fuse=True)], limit)["span"]
        split = paired_optima(cost, [_rows(cost, m, limit[0], fuse=False)], limit)["span"]
        assert best <= split + TOL
        fused_pays += best < split - TOL
        problem = Problem.make(cost, m, limit, "span")
        rows, pairs = local_search_paired(problem, sequential_schedule(problem), None, float("inf"),
                                          evaluations=3000, seed=seed, target=best * (1 + TOL))
        sched = Schedule.build("searched", prof, m, [0, 0], rows, memory_limit=list(limit), overlapped=pairs)
        assert find_problem(sched) is None, seed
        value, _ = problem.evaluate(rows, pairs)
        assert value >= best * (1 - TOL), seed
        if value <= best * (1 + TOL):
            reached += 1
            if best < split - TOL:  # what no split schedule reaches: a BW inside a pair
                assert any(row[i + 1].op is Op.BW for row, at in zip(rows, pairs or []) for i in at), seed
    assert fused_pays >= len(seeds) // 2
    assert reached >= 0.9 * len(seeds), reached
