"""The exact MILP with overlapped pairs where fusing a backward is a choice, against enumeration.

On tiny instances (p = 2, one stage per rank, m = 2) with all-to-all in F and B and a BW that
costs less than B + W (and an F that may cost less before a BW), or one that costs B + W but in
a pair hides more of the forward's all-to-all than its B does, the oracle enumerates every
per-rank order of F, B and W, every subset of fused backwards and every set of pairs (a forward
and the backward, B or BW, of another microbatch right after it), and simulates each
combination. Checked: the exact MILP's dual bound never above the optimum, its schedules valid
and never below it, and the relaxed model's optimum at most it for the makespan (an F's price is
not tied to its microbatch's choice there: a relaxation), its schedules at the optimum on most;
with recomputation offered (no bound) its schedules never below the optimum over every order,
recomputation and pairing, and at it on most; that pairs and fusing both pay on a share of the instances, so the oracle
is not trivial.
"""

from __future__ import annotations

import itertools
import random

import pytest

from tests.helpers.reference import rank_orders
from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import Action, Op
from zbsearch.layout import placement
from zbsearch.solver import solve
from zbsearch.solver.engines import ExactMILP
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.milp import exact
from zbsearch.solver.problem import Problem

from .oracle import paired_optima

TOL = 1e-9


def _instance(seed: int):
    rng = random.Random(seed if seed % 2 == 0 else 7 + (seed + 1) // 2)
    stages = []
    for _ in range(2):
        if seed % 2:  # fusing saves nothing alone; a BW only hides more of a forward's all-to-all
            t_f, t_b, t_w = round(rng.uniform(1.5, 2.5), 2), round(rng.uniform(0.4, 0.8), 2), round(rng.uniform(0.3, 3.0), 2)
            stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0, m_b=-0.5, m_w=-0.5,
                                    a_f=round(t_f * rng.uniform(0.3, 0.8), 3), a_b=round(t_b * 0.5, 3)))
            continue
        t_f, t_b, t_w = (round(rng.uniform(0.5, 2.0), 2) for _ in range(3))
        t_bw = round(max(t_b, (t_b + t_w) * rng.uniform(0.5, 0.95)), 2)
        t_ff = round(t_f * rng.uniform(0.85, 1.0), 2)
        stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=t_w, t_bw=t_bw, t_ff=t_ff, m_f=1.0, m_b=-0.5, m_w=-0.5,
                                a_f=round(min(t_f, t_ff) * rng.uniform(0.1, 0.6), 3),
                                a_b=round(t_b * rng.uniform(0.3, 0.6), 3)))
    t_comm = rng.choice([0.0, 0.1]) if seed % 2 == 0 else 0.0
    prof = Profile(name=f"moe-fuse{seed}", memory_unit="activations", stages=stages, t_comm=t_comm)
    cost = CostModel.from_profile(prof, placement(2, 1, "v"))
    limit = None if seed % 2 or rng.random() < 0.5 else (float(rng.choice([1.5, 2])),) * 2
    return cost, 2, limit, prof


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


def _optima(cost: CostModel, m: int, limit) -> dict[str, float]:
    return paired_optima(cost, [_rows(cost, r, m) for r in range(cost.num_ranks)], limit)


@pytest.fixture(scope="module")
def cases():
    out = []
    for seed in range(12):
        cost, m, limit, _ = _instance(seed)
        out.append((seed, cost, m, limit, _optima(cost, m, limit), _optima(cost.without_all_to_all(), m, limit)))
    return out


def test_pairs_and_fusing_both_pay(cases):
    paired = 0
    for *_, best, plain in cases:
        assert best["makespan"] <= plain["makespan"] + TOL
        paired += best["makespan"] < plain["makespan"] - TOL
    assert paired >= len(cases) // 4
    # fusing may pay on every stage of the even seeds, on no stage of the odd ones but in a pair
    assert all(cost.fuse_saves(s) != seed % 2 for seed, cost, *_ in cases for s in range(cost.num_stages))


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


def test_solves_with_the_exact_milp_claim_only_what_holds(cases):
    # the exact MILP as the solve's only engine, its bound now used with the fusing choice: never
    # above the optimum, the schedule never below it, 'optimal' only at it, and proven on some
    proven = 0
    for seed, cost, m, limit, best, _ in cases[:6]:
        prof = _instance(seed)[3]
        res = solve(prof, m, list(limit) if limit else None, time_limit=30, objective="makespan", engines=[ExactMILP()])
        if res.schedule.stage_to_rank != list(cost.stage_to_rank):  # a classic schedule on another placement won
            best = dict(best, makespan=min(best["makespan"], res.info.value))
        assert res.info.lower_bound <= best["makespan"] * (1 + TOL), seed
        assert res.info.value >= best["makespan"] * (1 - TOL), seed
        assert res.info.status != "optimal" or res.info.value <= best["makespan"] * (1 + 1e-6), seed
        proven += res.info.status == "optimal"
    assert proven >= 3


def _recompute_instance(seed: int):
    """p = 2, m = 2, full recomputation offered on both stages (the checkpointed F slower and
    holding less); W takes no time and frees nothing, so split and fused backwards time and hold
    alike and the oracle enumerates fused ones only."""
    rng = random.Random(1000 + seed)
    stages = []
    for _ in range(2):
        t_f, t_b = round(rng.uniform(0.5, 2.0), 2), round(rng.uniform(0.5, 2.5), 2)
        a_f = round(t_f * rng.uniform(0.1, 0.6), 3)
        stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=0.0, t_bw=t_b, m_f=1.0, m_b=-1.0, m_w=0.0,
                                t_fc=round(t_f * rng.uniform(1.0, 1.05), 2), t_r=round(a_f + t_f * rng.uniform(0.01, 0.1), 2),
                                m_fc=round(rng.uniform(0.1, 0.3), 2), a_f=a_f, a_b=round(t_b * rng.uniform(0.3, 0.6), 3)))
    prof = Profile(name=f"moe-redo{seed}", memory_unit="activations", stages=stages, t_comm=rng.choice([0.0, 0.1]))
    cost = CostModel.from_profile(prof, placement(2, 1, "v"))
    limit = None if seed % 4 == 0 else (float(rng.choice([1.2, 1.4])),) * 2
    return cost, 2, limit


def _recompute_rows(cost: CostModel, r: int, m: int) -> list[list[Action]]:
    """Every order of rank r's forwards and fused backwards, with each microbatch's forward on
    each stage plain or recomputed (its R anywhere between its F and its backward)."""
    out: list[list[Action]] = []
    for row in rank_orders(cost, r, m, ops=(Op.F, Op.B), fuse=True):
        keys = [(x.stage, x.mb) for x in row if x.op is Op.F]
        for bits in itertools.product((False, True), repeat=len(keys)):
            rows = [row]
            for (s, j), on in zip(keys, bits):
                if not on:
                    continue
                grown = []
                for x in rows:
                    f, b = x.index(Action(s, Op.F, j)), x.index(Action(s, Op.BW, j))
                    grown += [[*x[:n], Action(s, Op.R, j), *x[n:]] for n in range(f + 1, b + 1)]
                rows = grown
            out += rows
    return out


def test_the_exact_milp_with_pairs_and_recomputation_against_the_oracle():
    """With recomputation offered the exact MILP searches FIFO orders (no bound): its schedules
    valid and never below the oracle's optimum over every order, recomputation and pairing, the
    ASAP model timing them as the simulator does, and at the optimum on most instances."""
    hit = runs = recomputed = paired = 0
    for seed in range(12):
        cost, m, limit = _recompute_instance(seed)
        best = paired_optima(cost, [_recompute_rows(cost, r, m) for r in range(cost.num_ranks)], limit)["span"]
        problem = Problem.make(cost, m, limit, "span", recompute="auto")
        res = exact(problem, sequential_schedule(problem), 30, relaxed=False)
        assert res is not None and res.optimal, seed
        value, tl = problem.evaluate(res.rows, res.pairs)
        assert problem.fits(tl) and value >= best * (1 - TOL), (seed, value, best)
        assert res.dual_bound == -float("inf") and res.model_value >= value * (1 - 1e-6), seed
        runs += 1
        hit += value <= best * (1 + 1e-6)
        recomputed += any(x.op is Op.R for row in res.rows for x in row)
        paired += res.pairs is not None
    assert hit >= 0.75 * runs, (hit, runs)
    assert recomputed > 0 and paired > 0  # both choices made on these instances
