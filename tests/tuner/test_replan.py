"""``tune``'s second look: the configurations that may win planned again with more time, each
keeping its best plan; and the rule that picks them (``replan_order``)."""

from __future__ import annotations

import math
import random

import pytest

from zbsearch.planner import llama_layers
from zbsearch.solver.verdict import CLOSED
from zbsearch.tuner import Cluster, tune
from zbsearch.tuner.search import replan_order


def _case(rng: random.Random) -> list[tuple[float | None, float | None]]:
    """Configurations as tune holds them: costed (an iteration and a bound at most it, some
    proven), not costed with a bound (stopped, not planned), or neither."""
    out: list[tuple[float | None, float | None]] = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        v = float(rng.choice([rng.randint(90, 130), rng.uniform(90, 130)]))  # ties too
        if kind < 0.6:
            out.append((v, v if rng.random() < 0.15 else v * rng.uniform(0.7, 1.0)))
        elif kind < 0.9:
            out.append((None, v * rng.uniform(0.7, 1.0)))
        else:
            out.append((v, None) if rng.random() < 0.5 else (None, None))
    return out


@pytest.mark.parametrize("top, within", [(3, 0.05), (1, 0.0), (5, 0.2)])
def test_replan_order_takes_the_fastest_then_the_others_by_bound_and_none_that_cannot_win(top, within):
    rng = random.Random(top * 100 + int(within * 100))
    for _ in range(1500):
        found = _case(rng)
        got = replan_order(found, top, within)
        best = min((v for v, _ in found if v is not None), default=math.inf)
        can_win = [i for i, (_, b) in enumerate(found) if b is None or b < best * (1 - CLOSED)]
        assert len(got) == len(set(got)) and set(got) <= set(can_win), (found, got)
        close = [i for i in can_win if found[i][0] is not None and found[i][0] <= best * (1 + within)]
        n = min(top, len(close))
        fastest, rest = got[:n], got[n:]
        # the fastest part: the n fastest of those close to the best, fastest first
        assert set(fastest) <= set(close)
        assert sorted(found[i][0] for i in fastest) == sorted(found[i][0] for i in close)[:n]
        assert [found[i][0] for i in fastest] == sorted(found[i][0] for i in fastest)
        # then every other that can win and has a bound, least bound first
        others = [i for i in can_win if i not in fastest and found[i][1] is not None]
        assert sorted(rest) == sorted(others)
        assert [found[i][1] for i in rest] == sorted(found[i][1] for i in rest)


def test_replan_order_on_a_proven_best_and_on_nothing_costed():
    assert replan_order([(100.0, 100.0), (105.0, 100.0), (120.0, 101.0)]) == []  # nothing can beat a proven best
    assert replan_order([(None, 50.0), (None, 40.0), (None, None)]) == [1, 0]  # stopped ones: by their bounds
    assert replan_order([(100.0, 100.0), (105.0, 99.0)]) == [1]  # it may beat the proven best: only it
    assert replan_order([]) == []


@pytest.mark.slow  # two tunes of a small grid, each planning a few configurations twice
def test_tune_plans_the_likely_winners_again_keeps_their_best_and_chooses_alike_twice():
    profiles = [llama_layers(6, 512, 8000, heads=8, seq=512, microbatch_size=b, tflops=rate, name=f"tiny-b{b}")
                for b, rate in ((1, 30.0), (2, 40.0), (4, 45.0))]
    cluster = Cluster(ranks=8, ranks_per_node=4, memory_bytes=1.2 * 2**30, intra_node_gbs=20.0, inter_node_gbs=2.0,
                      memory_gbs=200.0)
    winners = []
    for _ in range(2):
        tuned = tune(profiles, cluster, 32, optimizer="mixed", sharded=True, time_limit=120, plan_time=0.4,
                     baselines=False)
        res = tuned.result
        costed = [r for r in res.rows if r.status == "costed"]
        assert costed and res.winner is not None and tuned.schedule is not None
        for r in costed:  # each keeps the best of its plans, and its bound holds for all of them
            assert r.plans_ms and r.iteration_ms == min(r.plans_ms)
            assert r.bound_ms is not None and r.bound_ms <= min(r.plans_ms) * (1 + 1e-9)
        assert res.winner.iteration_ms == min(r.iteration_ms for r in costed)
        # the winner's schedule is that of its best plan, whichever plan found it
        assert max(tuned.schedule.predicted.iteration) == pytest.approx(res.winner.iteration_ms)
        w = res.winner
        assert len(w.plans_ms) >= 2 or w.bound_ms >= w.iteration_ms * (1 - CLOSED)  # looked at twice, or proven
        assert sum(len(r.plans_ms or []) >= 2 for r in res.rows) >= 2
        winners.append((w.pp, w.dp, w.microbatch_size, w.microbatches, w.placement, w.iteration_ms))
    # the same inputs twice: the same winner, predicted alike (each time the best of longer plans)
    assert winners[0][:5] == winners[1][:5], winners
    assert winners[0][5] == pytest.approx(winners[1][5], rel=0.01), winners
