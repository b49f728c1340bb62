"""``--recompute auto`` offers a superset of the choices of "none" and "full": its solve must never
return a schedule worse than theirs would be built at the same limit, and its frontier must never
rise above the constructions without recomputation at any of its points.

The reference values come from the construction itself (``construct``), called directly on the
problem restricted to "none" or "full" with no deadline and no wait refinement, so they do not
depend on the machine's speed; the solves run without the MILP and with time to spare on these
small generated instances, so their constructions complete too.
"""

from __future__ import annotations

import random

import pytest

from tests.solver.oracle import FAMILIES, random_instance, with_recompute
from zbsearch.solver import frontier, solve
from zbsearch.solver.construct import construct
from zbsearch.solver.heuristic import sequential_schedule
from zbsearch.solver.problem import Problem

pytestmark = pytest.mark.slow

_TOL = 1e-9


def _restricted_best(inst, mode: str, limit: list[float] | None) -> float:
    """The construction's value recomputing as ``mode`` says, inf where that cannot fit."""
    problem = Problem.make(inst.cost, inst.m, None if limit is None else tuple(limit), "span", mode)
    if not problem.fits_order(sequential_schedule(problem)):
        return float("inf")
    _, _, tl, _, _, _ = construct(problem, float("inf"), float("inf"), refine=0.0)
    return problem.value(tl)


def _cases(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        p, chunks = rng.choice([(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)])
        m = rng.choice([p, p + 1, 2 * p])
        x = rng.choice(["0.34p", "0.5p", "0.75p", "1p", "1.5p"])
        inst = with_recompute(rng, random_instance(rng, rng.choice(FAMILIES), p, m, chunks, x),
                              selective=rng.random() < 0.5)
        yield inst


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_auto_is_never_worse_than_none_or_full(seed):
    checked = 0
    for inst in _cases(4, seed):
        refs = [_restricted_best(inst, mode, inst.limit) for mode in ("none", "full")]
        if min(refs) == float("inf"):
            continue  # only recomputing part of the microbatches fits: nothing to compare
        res = solve(inst.profile, inst.m, inst.limit, chunks=inst.chunks, time_limit=60, milp=False,
                    recompute="auto")
        assert res.info.value <= min(refs) * (1 + _TOL), (inst.limit_name, refs, res.info.value)
        checked += 1
    assert checked  # the draw holds limits where "none" or "full" fits


def test_auto_frontier_is_monotone_and_never_above_the_constructions_without_recomputation():
    rng = random.Random(7)
    for p, chunks in ((3, 1), (2, 2)):
        inst = with_recompute(rng, random_instance(rng, "hetero", p, 2 * p, chunks, "none"))
        fr = frontier(inst.profile, inst.m, chunks=chunks, recompute="auto", time_limit=60)
        spans = [pt.span for pt in fr.points]
        assert all(a >= b * (1 - _TOL) for a, b in zip(spans, spans[1:]))
        units = [p * inst.cost.activation_unit(r) for r in range(p)]
        for pt in fr.points:
            limit = [pt.limit * u for u in units]
            for mode in ("none", "full"):
                assert pt.span <= _restricted_best(inst, mode, limit) * (1 + _TOL), (pt.limit, mode)
