"""Checkpointing a classic order into a memory limit (``zbsearch.solver.checkpointing``).

Each result is judged by the core: the validator (dependencies, every pass once, recompute
passes before their backward, memory within the limit on the cost model's own pricing) and the
memory trace. It must also be the given order, only with forwards checkpointed, their recompute
passes placed just before their backward and some W passes moved earlier: F, B and fused
backward passes keep their order on each rank.
"""

from __future__ import annotations

import random

import pytest

from tests.solver.oracle import FAMILIES, random_instance, with_recompute
from zbsearch import Schedule, build_classic, load_profile
from zbsearch.actions import RECOMPUTES, Op
from zbsearch.classic import KINDS
from zbsearch.costs import CostModel
from zbsearch.layout import placement
from zbsearch.limits import parse_memory_limit
from zbsearch.simulator import memory_trace, peak_memory
from zbsearch.solver.checkpointing import checkpointed
from zbsearch.solver.feasibility import smallest_feasible_limit
from zbsearch.solver.problem import Problem
from zbsearch.validator import find_problem

_KINDS = {1: ("zb-h2", "zb-h1", "1f1b-split", "1f1b"), 2: ("zb-v", "v-half", "v-min")}


def _cases(seed: int):
    """Generated instances with recomputation offered (selective too on some), each with the
    classic orders of its placement and limits from the least any schedule needs with
    recomputation to the order's own peak."""
    rng = random.Random(seed)
    for _ in range(6):
        chunks = rng.choice([1, 1, 2])
        p = rng.choice([2, 3, 4])
        m = rng.choice([p, 2 * p, 3 * p])
        inst = with_recompute(rng, random_instance(rng, rng.choice(FAMILIES), p, m, chunks, "none"),
                              selective=rng.random() < 0.6)
        cost = inst.cost
        least = smallest_feasible_limit(cost, m, "auto")
        for kind in _KINDS[chunks]:
            rows = KINDS[kind].build_by(cost, m)
            peak = peak_memory(memory_trace(rows, cost))
            for x in (0.0, 0.2, 0.5, 0.8):
                yield inst, kind, rows, [lo + x * (hi - lo) for lo, hi in zip(least, peak)]


@pytest.mark.parametrize("seed", range(4))
def test_checkpointed_orders_are_valid_within_the_limit_and_keep_the_order(seed):
    built = 0
    for inst, kind, rows, limit in _cases(seed):
        problem = Problem.make(inst.cost, inst.m, tuple(limit), "span", "auto")
        out = checkpointed(problem, rows)
        if out is None:
            continue
        built += 1
        sched = Schedule.build("checkpointed", inst.profile, inst.m, inst.stage_to_rank, out, memory_limit=limit)
        assert find_problem(sched) is None, (kind, limit)
        assert problem.fits_order(out)
        cost = problem.cost
        for row, new in zip(rows, out):
            # the same passes, F, B and BW in the same order on the rank
            assert sorted(map(str, row)) == sorted(str(a) for a in new if a.op not in RECOMPUTES)
            keep = [a for a in row if a.op is not Op.W]
            assert keep == [a for a in new if a.op not in RECOMPUTES and a.op is not Op.W]
            for i, a in enumerate(new):  # each recompute pass offered, right before its backward
                if a.op in RECOMPUTES:
                    assert a.op in cost.recompute_ops(a.stage)
                    nxt = new[i + 1]
                    assert (nxt.stage, nxt.mb) == (a.stage, a.mb) and nxt.op in (Op.B, Op.BW)
        if problem.fits_order(rows):  # nothing to change where the order fits already
            assert out == [list(r) for r in rows]
    assert built  # the draw holds limits the orders can be checkpointed into


def test_checkpointed_zb_h1_at_half_of_1f1bs_memory_beats_full_recomputation():
    """On the paper's 1.5B profile at 0.5p ZB-H1 needs twice the limit; checkpointed where the
    limit binds, it recomputes fewer passes than ZB-H1 with full recomputation and is shorter."""
    prof = load_profile("1.5b-m24")
    cost = CostModel.from_profile(prof, placement(8, 1, "v"))
    limit = parse_memory_limit("0.5p", prof, cost)
    problem = Problem.make(cost, 24, tuple(limit), "span", "auto")
    rows = KINDS["zb-h1"].build_by(problem.cost, 24)
    assert not problem.fits_order(rows)
    out = checkpointed(problem, rows)
    assert out is not None
    value, tl = problem.evaluate(out)
    assert problem.fits(tl)
    full = build_classic("zb-h1-recompute", prof, 24)
    recomputed = sum(a.op in RECOMPUTES for row in out for a in row)
    assert recomputed < sum(a.op in RECOMPUTES for row in full.rank_actions for a in row)
    assert value < max(full.predicted.span)
