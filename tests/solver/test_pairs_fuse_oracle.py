"""The exact MILP with overlapped pairs where fusing a backward is a choice, against enumeration.

On tiny instances (p = 2, one stage per rank, m = 2) with all-to-all in F and B and a BW that
costs less than B + W (and an F that may cost less before a BW), the oracle enumerates every
per-rank order of F, B and W, every subset of fused backwards and every set of pairs (a forward
and the backward, B or BW, of another microbatch right after it), and simulates each
combination. Checked: the exact MILP's dual bound never above the optimum, its schedules valid
and never below it, and the relaxed model's optimum equal to it for the makespan (FIFO orders
lose nothing there, but an F's price is not tied to its microbatch's choice: a relaxation), its schedules at the optimum on most; that pairs and fusing both pay on a share of the instances, so the oracle
is not trivial.
"""

from __future__ import annotations

import itertools
import random

import pytest

from tests.helpers.reference import rank_orders
from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import Action, Op
from zbsearch.errors import ZbError
from zbsearch.layout import placement
from zbsearch.simulator import simulate
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.milp import exact
from zbsearch.solver.problem import Problem

TOL = 1e-9


def _instance(seed: int):
    rng = random.Random(seed)
    stages = []
    for _ in range(2):
        t_f, t_b, t_w = (round(rng.uniform(0.5, 2.0), 2) for _ in range(3))
        t_bw = round(max(t_b, (t_b + t_w) * rng.uniform(0.5, 0.95)), 2)
        t_ff = round(t_f * rng.uniform(0.85, 1.0), 2)
        stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=t_w, t_bw=t_bw, t_ff=t_ff, m_f=1.0, m_b=-0.5, m_w=-0.5,
                                a_f=round(min(t_f, t_ff) * rng.uniform(0.1, 0.6), 3),
                                a_b=round(t_b * rng.uniform(0.1, 0.6), 3)))
    prof = Profile(name=f"moe-fuse{seed}", memory_unit="activations", stages=stages, t_comm=rng.choice([0.0, 0.1]))
    cost = CostModel.from_profile(prof, placement(2, 1, "v"))
    limit = None if rng.random() < 0.5 else (float(rng.choice([1.5, 2])),) * 2
    return cost, 2, limit


def _rows(cost: CostModel, r: int, m: int) -> list[list[Action]]:
    """Every order of rank r's passes with every subset of its backwards fused (a fused one's W dropped)."""
    out = set()
    mine = [(s, j) for s in cost.rank_stages(r) for j in range(m)]
    for row in rank_orders(cost, r, m):
        for fused in itertools.product((False, True), repeat=len(mine)):
            on = {k for k, f in zip(mine, fused) if f}
            out.add(tuple(Action(a.stage, Op.BW, a.mb) if a.op is Op.B and (a.stage, a.mb) in on else a
                          for a in row if not (a.op is Op.W and (a.stage, a.mb) in on)))
    return [list(row) for row in sorted(out)]


def _pairings(row: list[Action]) -> list[list[int]]:
    out: list[list[int]] = []

    def rec(i: int, got: list[int]) -> None:
        if i >= len(row) - 1:
            out.append(list(got))
            return
        rec(i + 1, got)
        if row[i].op is Op.F and row[i + 1].op in (Op.B, Op.BW) and row[i].mb != row[i + 1].mb:
            rec(i + 2, [*got, i])

    rec(0, [])
    return out


def _optima(cost: CostModel, m: int, limit) -> dict[str, float]:
    best = {"span": float("inf"), "makespan": float("inf")}
    per_rank = [[(row, pairs) for row in _rows(cost, r, m) for pairs in _pairings(row)] for r in range(cost.num_ranks)]
    for combo in itertools.product(*per_rank):
        rows, pairs = [c[0] for c in combo], [c[1] for c in combo]
        try:
            tl = simulate(rows, cost, pairs)
        except ZbError:
            continue
        if limit is None or all(p <= x + TOL for p, x in zip(tl.peak_memory, limit)):
            best["span"] = min(best["span"], max(tl.span))
            best["makespan"] = min(best["makespan"], tl.makespan)
    return best


@pytest.fixture(scope="module")
def cases():
    out = []
    for seed in range(12):
        cost, m, limit = _instance(seed)
        out.append((seed, cost, m, limit, _optima(cost, m, limit), _optima(cost.without_all_to_all(), m, limit)))
    return out


def test_pairs_and_fusing_both_pay(cases):
    paired = 0
    for _, cost, m, limit, best, plain in cases:
        assert best["makespan"] <= plain["makespan"] + TOL
        paired += best["makespan"] < plain["makespan"] - TOL
    assert paired >= len(cases) // 4
    # every instance offers the choice (fusing may pay on each stage)
    assert all(cost.fuse_saves(s) for _, cost, *_ in cases for s in range(cost.num_stages))


def test_the_exact_milp_with_pairs_and_the_fusing_choice_against_the_oracle(cases):
    chose = hit = runs = 0
    for seed, cost, m, limit, best, _ in cases:
        for objective in ("makespan", "span"):
            problem = Problem.make(cost, m, limit, objective)
            start = sequential_schedule(problem)
            for relaxed in (True, False) if objective == "span" else (True,):
                res = exact(problem, start, 30, relaxed=relaxed)
                assert res is not None and res.optimal, (seed, objective, relaxed)
                value, tl = problem.evaluate(res.rows, res.pairs)
                assert problem.fits(tl), seed
                assert value >= best[objective] * (1 - TOL), (seed, objective, relaxed)
                if relaxed:
                    assert res.dual_bound <= best[objective] * (1 + TOL), (seed, objective, res.dual_bound, best)
                    assert res.dual_bound > -float("inf")
                else:
                    assert res.model_value >= value * (1 - 1e-6), (seed, objective)  # ASAP: the model times it
                if objective == "makespan":  # a relaxation (an F's price is not tied to its microbatch's choice)
                    assert res.model_value <= best[objective] * (1 + 1e-6), (seed, relaxed, res.model_value, best)
                    runs += 1
                    hit += value <= best[objective] * (1 + 1e-6)
                chose += res.pairs is not None and any(x.op is Op.BW for row in res.rows for x in row)
    assert chose > 0
    assert hit >= 0.75 * runs, (hit, runs)
