"""The iteration a configuration is costed at, against the closed form of 1F1B; the bound
before planning against every cut's schedules; the proof that nothing fits against every cut."""

from __future__ import annotations

import itertools
import random

import pytest

import zbsearch as zb
from tests.helpers.layers import random_layers
from zbsearch.formats.layers import LayerProfile, LinkEstimate, Unit
from zbsearch.limits import allowance
from zbsearch.planner import Cut
from zbsearch.planner.compose import activation_need
from zbsearch.planner.search import compositions
from zbsearch.reductions import reduction_time
from zbsearch.tuner import Cluster, Mesh, OptimizerSetup
from zbsearch.tuner.bounds import cannot_fit, config_bound
from zbsearch.tuner.costing import full_profile, rank_static
from zbsearch.tuner.evaluate import Task, evaluate
from zbsearch.tuner.space import Config


def _uniform(n: int, f: float, bw: float, params: int) -> LayerProfile:
    units = [Unit(name=f"u{i}", t_f=f, t_ff=f, t_b=bw / 2, t_w=bw / 2, t_bw=bw, m_f=10.0, m_b=-5.0, m_w=-5.0,
                  params=params, param_bytes=4.0 * params) for i in range(n)]
    return LayerProfile(name="uniform", units=units, link=LinkEstimate(latency_ms=0.0, bandwidth_gb_s=1e9),
                        microbatch_size=1)


def test_1f1b_iteration_is_its_closed_form_plus_reduction_and_step():
    p, m, dp, f, bw, params = 4, 6, 4, 1.0, 2.0, 1_000_000
    layers = _uniform(2 * p, f / 2, bw / 2, params)
    cluster = Cluster(ranks=p * dp, ranks_per_node=dp, intra_node_gbs=40.0, inter_node_gbs=4.0, memory_gbs=1000.0)
    opt = OptimizerSetup("adamw")
    ev = evaluate(Task(Config(Mesh(p, dp, 1), 1, m, "one", "none", "1f1b", "test", (2,) * p), layers.model_copy(
        update={"link": LinkEstimate(latency_ms=0.0, bandwidth_gb_s=1e12)}), cluster, opt, 1.0, 0.0))
    assert ev.status == "costed" and ev.kind == "1f1b"
    grads = 2 * 4.0 * params  # two units' fp32 gradients per stage
    reduce = 2 * (dp - 1) / dp * grads / 4.0e10 * 1e3  # ring all-reduce across the 4 replicas of one node: 40 GB/s
    step = 2 * 7 * 4.0 * params / 1e12 * 1e3  # adamw streams 7x the parameter bytes at 1000 GB/s
    assert ev.costed.iteration == pytest.approx((m + p - 1) * (f + bw) + reduce + step)
    # adamw holds 4x the parameter bytes, the buckets one more copy of the gradients; 1F1B p microbatches on rank 0
    assert ev.costed.peak_bytes[0] == pytest.approx(2 * 5 * 4.0 * params + p * 2 * 10.0)


def _schedules(layers, counts, placement, m, mesh, cluster, opt):
    prof = full_profile(layers, counts, placement, mesh, cluster, opt)
    kinds = ("1f1b", "zb-h1", "gpipe") if placement == "one" else ("zb-v",)
    for kind in kinds:
        s = zb.build_classic(kind, prof, m)
        yield max(s.predicted.iteration)


@pytest.mark.parametrize("seed, pp, placement, m, dp", [(1, 2, "one", 4, 2), (2, 3, "one", 5, 1), (3, 2, "v", 4, 4),
                                                         (4, 2, "one", 1, 2), (5, 3, "v", 6, 2)])
def test_bound_before_planning_holds_for_every_cut_and_schedule(seed, pp, placement, m, dp):
    layers = random_layers(seed, 6, head=4.0, tied=seed % 2 == 1)
    cluster = Cluster(ranks=pp * dp, ranks_per_node=dp, intra_node_gbs=0.2, inter_node_gbs=0.05, memory_gbs=0.5)
    mesh, opt = Mesh(pp, dp, 1), OptimizerSetup("mixed", sharded=seed % 2 == 0)
    bound = config_bound(layers, mesh, placement, m, "none", cluster, opt)
    stages = pp * (2 if placement == "v" else 1)
    least = min(it for counts in compositions(layers.num_units, stages)
                for it in _schedules(layers, counts, placement, m, mesh, cluster, opt))
    assert 0 < bound <= least * (1 + 1e-9)
    single = Mesh(1, pp * dp, 1)
    one = next(_schedules(layers, (layers.num_units,), "one", m, single, cluster, opt))
    assert config_bound(layers, single, "one", m, "none", cluster, opt) <= one * (1 + 1e-9)


def _fits(layers, counts, placement, ranks, budget, opt, dp) -> bool:
    static = rank_static(layers, counts, placement, ranks, opt, dp)
    need = activation_need(layers, Cut(tuple(counts), placement), "auto")
    return all(s < budget and n <= allowance(budget - s) for s, n in zip(static, need))


def test_a_proof_that_nothing_fits_holds_for_every_cut():
    rng = random.Random(0)
    proved = fitted = 0
    for trial in range(40):
        layers = random_layers(trial, 7, head=3.0, tied=trial % 3 == 0, recompute="full")
        pp, placement = rng.choice([(2, "one"), (3, "one"), (4, "one"), (2, "v"), (3, "v")])
        opt, dp = OptimizerSetup(rng.choice(["sgd", "adamw", "mixed"]), rng.random() < 0.5), rng.choice([1, 2, 4])
        budget = 10 ** rng.uniform(6, 7.5)
        stages = pp * (2 if placement == "v" else 1)
        why = cannot_fit(layers, stages, pp, budget, opt, dp)
        some = any(_fits(layers, c, placement, pp, budget, opt, dp) for c in compositions(layers.num_units, stages))
        if why is not None:
            proved += 1
            assert not some, why
        fitted += some
    assert proved >= 5 and fitted >= 5  # both cases were seen


def test_every_cut_of_itertools_is_a_composition():  # the enumeration above covers every cut
    assert len(list(compositions(7, 3))) == len(list(itertools.combinations(range(1, 7), 2)))


def test_reduction_of_one_stage_is_the_whole_models():
    layers = random_layers(9, 4)
    cluster = Cluster(ranks=4, ranks_per_node=2, intra_node_gbs=10.0, inter_node_gbs=1.0)
    prof = full_profile(layers, (layers.num_units,), "one", Mesh(1, 4, 1), cluster, OptimizerSetup("adamw"))
    assert prof.stages[0].t_reduce == pytest.approx(reduction_time(sum(u.param_bytes for u in layers.units), 4, 1.0))
