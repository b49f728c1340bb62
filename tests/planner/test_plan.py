"""The planner against enumeration: every cut solved by the solver, on instances small enough.

The plan's value must be within 1% of the best cut's, its bound never above the best value
found over every cut (nor above any cut's proven optimum), and its schedule valid within the
budget once parameters, gradients and optimizer state are counted.
"""

from __future__ import annotations

import pytest

import zbsearch as zb
from tests.helpers.layers import random_layers
from zbsearch.errors import ZbError
from zbsearch.limits import fits
from zbsearch.planner import Cut, plan, stage_profile
from zbsearch.planner.compose import activation_need, static_bytes
from zbsearch.planner.search import compositions

pytestmark = pytest.mark.slow


def _every_cut(layers, ranks, placement, m, budget, optimizer="adamw"):
    """(value, optimal?) of the solver on every feasible cut; the best."""
    stages = ranks * (2 if placement == "v" else 1)
    out = {}
    for counts in compositions(layers.num_units, stages):
        cut = Cut(counts, placement)
        limit = [budget - s for s in static_bytes(layers, cut, optimizer)]
        if any(n > x for n, x in zip(activation_need(layers, cut), limit)):
            continue
        res = zb.solve(stage_profile(layers, cut), m, limit, chunks=cut.chunks, time_limit=0.3)
        out[counts] = (res.info.value, res.info.status == "optimal")
    return out


@pytest.mark.parametrize("seed, layers, ranks, m, placement, tight", [
    (1, 5, 2, 4, "v", False),
    (2, 5, 3, 3, "one", True),
    (3, 4, 2, 3, "v", True),
])
def test_plan_is_within_one_percent_of_every_cut_and_its_bound_holds(seed, layers, ranks, m, placement, tight):
    L = random_layers(seed, layers, head=4.0)
    # a budget where the tight cases leave each rank a little over one microbatch in flight
    static = max(max(static_bytes(L, Cut(c, placement), "adamw"))
                 for c in compositions(L.num_units, ranks * (2 if placement == "v" else 1)))
    budget = static + (2.5e6 if tight else 1e9)
    every = _every_cut(L, ranks, placement, m, budget)
    best = min(v for v, _ in every.values())
    res = plan(L, ranks, m, budget, placement=placement, time_limit=4)
    part = res.partition
    assert part.value <= best * 1.01
    assert part.lower_bound <= best * (1 + 1e-9)
    assert part.exhaustive and part.placement == placement
    proven = [v for v, optimal in every.values() if optimal]
    if len(proven) == len(every):  # every cut solved to optimality: the bound is below the optimum
        assert part.lower_bound <= min(proven) * (1 + 1e-9)
    # the schedule is valid and within the budget with its static memory
    zb.validate(res.schedule)
    peaks = zb.timeline(res.schedule).peak_memory
    assert all(fits(s + a, budget) for s, a in zip(part.static_bytes, peaks))
    assert part.stages == res.cut.names(L)


def test_no_cut_within_the_budget_is_one_line():
    L = random_layers(4, 4)
    with pytest.raises(ZbError, match=r"no cut fits a budget of .* GiB per rank with adamw: the closest"):
        plan(L, 2, 4, 1e5, time_limit=2)


def test_auto_takes_the_better_placement_and_beats_every_baseline():
    L = random_layers(6, 10, head=6.0)
    res = plan(L, 3, 6, None, placement="auto", time_limit=4)
    part = res.partition
    assert part.placements_searched == ["one", "v"]
    values = [b.value for b in part.baselines if b.value is not None]
    assert values and part.value <= min(values) * (1 + 1e-9)
