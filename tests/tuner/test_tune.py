"""``tune`` against every configuration of a grid small enough to plan them all the same way,
and its time limit."""

from __future__ import annotations

import time

import pytest

from zbsearch.planner import llama_layers
from zbsearch.tuner import Cluster, OptimizerSetup, tune
from zbsearch.tuner.bounds import cannot_fit
from zbsearch.tuner.costing import on_cluster
from zbsearch.tuner.evaluate import Task, evaluate
from zbsearch.tuner.sizes import SizedLayers
from zbsearch.tuner.space import configurations

PLAN_S = 0.4


def _profiles(layers=6, vocab=8000):
    # a rank computes a larger microbatch faster per sequence, as accelerators do
    return [llama_layers(layers, 512, vocab, heads=8, seq=512, microbatch_size=b, tflops=rate, name=f"tiny-b{b}")
            for b, rate in ((1, 30.0), (2, 40.0), (4, 45.0))]


def _enumerate(profiles, cluster, batch, opt):
    """Every configuration, planned as tune plans it (the same time each): the iterations."""
    sized = SizedLayers(profiles)
    configs, _ = configurations(sized.reference.num_units, cluster.ranks, 1, batch, sized.measured, ("one", "v"),
                                ("auto",))
    out = {}
    for c in configs:
        layers = on_cluster(sized.at(c.b), c.mesh, cluster)
        if cannot_fit(layers, c.stages, c.mesh.pp, cluster.memory_bytes, opt, c.mesh.dp) is None:
            ev = evaluate(Task(c, layers, cluster, opt, PLAN_S, 0.0))
            if ev.costed is not None:
                out[str(c)] = ev.costed.iteration
    return out


@pytest.mark.slow  # plans every configuration of the grid, then tunes
@pytest.mark.parametrize("ranks, memory, batch, optimizer, sharded", [
    (4, 2 * 2**30, 16, "adamw", False), (8, 1.2 * 2**30, 32, "mixed", True),
])
def test_tune_is_within_one_percent_of_every_configuration_and_its_bound_holds(ranks, memory, batch, optimizer,
                                                                                sharded):
    profiles = _profiles()
    cluster = Cluster(ranks=ranks, ranks_per_node=4, memory_bytes=memory, intra_node_gbs=20.0, inter_node_gbs=2.0,
                      memory_gbs=200.0)
    opt = OptimizerSetup(optimizer, sharded)
    every = _enumerate(profiles, cluster, batch, opt)
    assert len(every) >= 4
    best = min(every.values())
    res = tune(profiles, cluster, batch, optimizer=optimizer, sharded=sharded, time_limit=120, plan_time=PLAN_S,
               baselines=False).result
    assert res.winner is not None and res.winner.iteration_ms <= best * 1.01
    assert res.lower_bound_ms <= best * (1 + 1e-9)
    assert res.gap == pytest.approx(res.winner.iteration_ms / res.lower_bound_ms - 1)
    assert res.bound_before_planning_ms is not None and res.bound_before_planning_ms <= best * (1 + 1e-9)
    assert res.bound_before_planning_ms <= res.lower_bound_ms * (1 + 1e-9)
    planned = [r for r in res.rows if r.status == "costed"]
    assert len(planned) < len(res.rows)  # some were pruned or proven not to fit
    assert all(r.bound_ms <= r.iteration_ms * (1 + 1e-9) for r in planned)


def test_the_time_limit_holds_and_the_winner_is_never_slower_than_a_baseline():
    profiles = _profiles(layers=8, vocab=32000)
    cluster = Cluster(ranks=8, ranks_per_node=8, memory_bytes=None, intra_node_gbs=50.0, inter_node_gbs=5.0)
    t0 = time.monotonic()
    tuned = tune(profiles, cluster, 32, time_limit=6.0, plan_time=0.3)
    took = time.monotonic() - t0
    res = tuned.result
    assert took <= 6.0 + 1.0  # the limit, and a worker's start
    assert res.winner is not None and tuned.schedule is not None
    base = res.best_baseline()
    assert base is not None and res.winner.iteration_ms <= base.iteration_ms
    assert max(tuned.schedule.predicted.iteration) == pytest.approx(res.winner.iteration_ms)
    assert {r.source for r in res.rows} >= {"tune", "torchtitan 1F1B", "Megatron 1F1B"}
    statuses = {r.status for r in res.rows}
    assert statuses <= {"costed", "pruned", "not planned", "stopped", "does not fit", "no schedule"}


@pytest.mark.slow  # plans every configuration of two grids
@pytest.mark.parametrize("memory, optimizer", [(0.3 * 2**30, "adamw"), (0.45 * 2**30, "mixed")])
def test_each_bound_before_planning_is_below_its_configurations_plan(memory, optimizer):
    """Tight memory (recomputation pays; some configurations fit nothing): every configuration's
    bound before planning, memory and recomputation counted, is at most what its plan costs."""
    from zbsearch.tuner.bounds import config_bound

    profiles, ranks, batch = _profiles(layers=12, vocab=16000), 16, 128
    cluster = Cluster(ranks=ranks, ranks_per_node=8, memory_bytes=memory, intra_node_gbs=20.0, inter_node_gbs=2.0,
                      memory_gbs=200.0)
    opt = OptimizerSetup(optimizer, True)
    sized = SizedLayers(profiles)
    configs, _ = configurations(sized.reference.num_units, ranks, 1, batch, sized.measured, ("one", "v"), ("auto",))
    costed = raised = 0
    for c in configs:
        layers = on_cluster(sized.at(c.b), c.mesh, cluster)
        if cannot_fit(layers, c.stages, c.mesh.pp, cluster.memory_bytes, opt, c.mesh.dp) is not None:
            continue
        bound = config_bound(layers, c.mesh, c.placement, c.m, c.recompute, cluster, opt)
        ev = evaluate(Task(c, layers, cluster, opt, PLAN_S, 0.0))
        if ev.costed is None:
            continue
        costed += 1
        assert bound <= ev.costed.iteration * (1 + 1e-9), (str(c), bound, ev.costed.iteration)
        free = config_bound(layers, c.mesh, c.placement, c.m, c.recompute, cluster.model_copy(update={"memory_bytes": None}),
                            opt)
        raised += bound > free * (1 + 1e-6)
    assert costed >= 6 and raised >= 1, (costed, raised)  # the memory raised some configuration's bound
