"""plan with sharded stages: the byte budget counts each rank's share of the stored parameters
and optimizer state (``parameter_bytes(shard=d)``), so a budget no cut fits whole can fit
sharded; the plan still matches the best of every cut solved the same way."""

from __future__ import annotations

import pytest

import zbsearch as zb
from tests.helpers.layers import random_layers
from zbsearch.errors import ZbError
from zbsearch.limits import fits
from zbsearch.planner import Cut, plan, stage_profile
from zbsearch.planner.compose import activation_need, static_bytes
from zbsearch.planner.search import compositions

SHARD = 4


def _need(L, cut, shard):
    """The least bytes a rank of this cut needs: its static memory and one microbatch's activations."""
    return max(s + a for s, a in zip(static_bytes(L, cut, "adamw", shard), activation_need(L, cut)))


@pytest.mark.parametrize("seed", [5, 6])
def test_a_budget_only_sharded_stages_fit_plans_the_best_cut(seed):
    L = random_layers(seed, 5, head=4.0)
    cuts = [Cut(c, "one") for c in compositions(L.num_units, 2)]
    sharded = min(_need(L, c, SHARD) for c in cuts)
    whole = min(_need(L, c, None) for c in cuts)
    assert sharded < whole  # the case this test is about
    budget = min(sharded * 1.3, (sharded + whole) / 2)
    with pytest.raises(ZbError, match=r"no cut fits a budget of .* GiB per rank with adamw"):
        plan(L, 2, 4, budget, placement="one", time_limit=2)
    res = plan(L, 2, 4, budget, placement="one", time_limit=4, shard=SHARD)
    part = res.partition
    assert part.shard == SHARD
    assert part.static_bytes == static_bytes(L, res.cut, "adamw", SHARD)
    # every cut that fits sharded, solved: the plan is within 1% of the best, its bound below it
    values = []
    for c in cuts:
        limit = [budget - s for s in static_bytes(L, c, "adamw", SHARD)]
        if all(n <= x for n, x in zip(activation_need(L, c), limit)):
            values.append(zb.solve(stage_profile(L, c), 4, limit, time_limit=0.5).info.value)
    assert values and part.value <= min(values) * 1.01
    assert part.lower_bound <= min(values) * (1 + 1e-9)
    peaks = zb.timeline(res.schedule).peak_memory
    assert all(fits(s + a, budget) for s, a in zip(part.static_bytes, peaks))


def test_shard_is_checked():
    with pytest.raises(ZbError, match="shard must be a positive whole number"):
        plan(random_layers(1, 3), 2, 2, None, shard=0, time_limit=1)
