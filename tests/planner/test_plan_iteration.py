"""Planning the iteration: with data parallelism, each cut's stages end the iteration with the
all-reduce of their units' gradients, and the plan minimises that iteration.

Judged by enumeration on tiny models: every cut, and for each every combination of per-rank
orders simulated with the reduction lane (``oracle.brute_force``)."""

from __future__ import annotations

import pytest

import zbsearch as zb
from tests.helpers.layers import random_layers
from tests.solver.oracle import brute_force
from zbsearch.errors import ZbError
from zbsearch.planner import Cut, plan, stage_profile
from zbsearch.planner.search import compositions


@pytest.mark.parametrize("seed", range(4))
def test_the_plans_iteration_is_sound_against_every_cut_and_order(seed):
    layers = random_layers(seed, 3)  # embedding, 3 layers, head
    dp = (8, 0.05 + 0.05 * seed)  # slow links: reductions about as long as the passes
    res = plan(layers, 2, 2, None, placement="one", time_limit=4, data_parallel=dp)
    part = res.partition
    assert part.objective == "iteration"
    best = float("inf")
    for counts in compositions(layers.num_units, 2):
        prof = stage_profile(layers, Cut(counts, "one"), dp)
        lo = 0
        for st, n in zip(prof.stages, counts):  # a ring all-reduce of the stage's parameter bytes
            grad = sum(u.param_bytes for u in layers.units[lo:lo + n])
            lo += n
            assert st.t_reduce == pytest.approx(2 * 7 / 8 * grad / (dp[1] * 1e9) * 1e3)
        optimum, _ = brute_force(zb.CostModel.from_profile(prof, [0, 1]), 2, None, "iteration", fused=True)
        best = min(best, optimum)
    sched = res.schedule
    tl = zb.simulate(sched.rank_actions, zb.CostModel.from_profile(sched.profile, sched.stage_to_rank))
    assert part.value == pytest.approx(tl.period, rel=1e-12)
    assert part.value >= best * (1 - 1e-9)
    assert part.lower_bound <= best * (1 + 1e-9)


def test_iteration_needs_data_parallelism_in_one_line():
    with pytest.raises(ZbError, match="needs the data parallelism"):
        plan(random_layers(0, 3), 2, 2, None, placement="one", time_limit=1, objective="iteration")
    with pytest.raises(ZbError, match="positive bandwidth"):
        plan(random_layers(0, 3), 2, 2, None, placement="one", time_limit=1, data_parallel=(8, 0.0))
