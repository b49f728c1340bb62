"""The cluster's mesh against an independent layout, and the optimizer's bytes as plan counts
them: what plan sees through ``plan_view`` is what the tuner costs."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.helpers.layers import random_layers
from zbsearch.errors import ZbError
from zbsearch.planner import Cut, parameter_bytes, rank_static_bytes, stage_profile
from zbsearch.reductions import reduction_time
from zbsearch.tuner import Cluster, Mesh, OptimizerSetup
from zbsearch.tuner.costing import full_profile, rank_static


def _layout(pp, dp, tp):
    """rank -> (p, d, t), counting with tp innermost, pp outermost (build_mesh's order)."""
    coords = list(itertools.product(range(pp), range(dp), range(tp)))
    return {r: c for r, c in enumerate(coords)}


@pytest.mark.parametrize("ranks, per_node", [(16, 8), (12, 4), (8, 8), (24, 6), (6, 4)])
def test_groups_share_a_node_exactly_where_the_layout_says(ranks, per_node):
    if ranks > per_node and ranks % per_node:
        with pytest.raises(ValueError):
            Cluster(ranks=ranks, ranks_per_node=per_node, intra_node_gbs=100, inter_node_gbs=10)
        return
    cl = Cluster(ranks=ranks, ranks_per_node=per_node, intra_node_gbs=100, inter_node_gbs=10)
    for tp in (1, 2, 3):
        for pp in (1, 2, 3, 4, 6):
            if ranks % (tp * pp):
                continue
            dp = ranks // (tp * pp)
            where = _layout(pp, dp, tp)
            groups = {}
            for r, (p, _, t) in where.items():
                groups.setdefault((p, t), []).append(r)
            inside = all(len({r // per_node for r in g}) == 1 for g in groups.values())
            pairs = all(r // per_node == s // per_node for r, (p, d, t) in where.items()
                        for s, c in where.items() if c == (p + 1, d, t))
            mesh = Mesh(pp, dp, tp)
            assert mesh.dp_within_nodes(cl) == inside and mesh.pp_within_nodes(cl) == pairs
            assert mesh.dp_bandwidth(cl) == (100 if inside else 10)


@pytest.mark.parametrize("ranks, per_node", [(16, 8), (12, 4), (8, 8), (24, 6), (8, 2)])
def test_the_ranks_of_a_node_share_its_link_where_it_holds_whole_pipeline_ranks(ranks, per_node):
    from zbsearch import CostModel

    layers = random_layers(3, 6, tied=False)
    cl = Cluster(ranks=ranks, ranks_per_node=per_node, intra_node_gbs=100, inter_node_gbs=10, dp_share=0.7)
    for tp in (1, 2, 3):
        for pp in (2, 3, 4, 6):
            if ranks % (tp * pp) or ranks // (tp * pp) < 2:
                continue
            dp = ranks // (tp * pp)
            nodes = {}  # pipeline rank -> the nodes its ranks lie in, from the layout
            for r, (p, _, _) in _layout(pp, dp, tp).items():
                nodes.setdefault(p, set()).add(r // per_node)
            whole = all(len(n) == 1 for n in nodes.values())
            link = tuple(min(nodes[p]) for p in range(pp))
            n = layers.num_units
            counts = tuple(n // pp + (i < n % pp) for i in range(pp))
            prof = full_profile(layers, counts, "one", Mesh(pp, dp, tp), cl, OptimizerSetup("adamw"))
            cost = CostModel.from_profile(prof, list(range(pp)))
            if whole and len(set(link)) < pp:  # some node holds two pipeline ranks or more: they share its link
                assert cost.lane_share == 0.7 and cost.lane_link == tuple(x - link[0] for x in link)
            else:
                assert not cost.shares_lanes
    plain = Cluster(ranks=8, ranks_per_node=8, intra_node_gbs=100, inter_node_gbs=10)
    assert plain.dp_share == 0 and Mesh(4, 2, 1).dp_sharing(plain) is None


def test_a_bad_cluster_is_one_line():
    with pytest.raises(ZbError, match="cluster: ranks") as e:
        Cluster.checked(ranks=0, ranks_per_node=8, intra_node_gbs=1, inter_node_gbs=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ZbError, match="cluster: dp_share") as e:
        Cluster.checked(ranks=8, ranks_per_node=8, intra_node_gbs=1, inter_node_gbs=1, dp_share=-1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["sgd", "adamw", "mixed"])
def test_replicated_bytes_are_the_planners(name):
    opt = OptimizerSetup(name)
    for params, pb in ((1000, 4000.0), (1000, 2000.0), (0, 0.0)):
        assert opt.static_bytes(params, pb, 1) == pytest.approx(parameter_bytes(params, pb, name))
    # sharded over 8: the state counts 1/8; with replicas, one more copy of the gradients
    sh = OptimizerSetup(name, sharded=True)
    state = {"sgd": 4000.0, "adamw": 8000.0, "mixed": 12000.0}[name]
    whole = parameter_bytes(1000, 4000.0, name)
    grads = 2000.0 if name == "mixed" else 4000.0
    assert sh.static_bytes(1000, 4000.0, 8) == pytest.approx(whole - state + state / 8 + grads)


@pytest.mark.parametrize("name", ["sgd", "adamw", "mixed"])
@pytest.mark.parametrize("dp", [2, 3, 8])
def test_fully_sharded_stages_hold_whole_working_copies_and_a_share_of_the_rest(name, dp):
    # at a step's peak fully_shard's stages hold each parameter and gradient whole (gathered for the
    # step); stored parameters and optimizer state are sharded over dp; no buckets
    opt = OptimizerSetup(name, fully_sharded=True)
    params, pb = 1000, 4000.0
    want = {"sgd": pb * (2 + 2 / dp), "adamw": pb * (2 + 3 / dp), "mixed": params * (4 + 12 / dp)}[name]
    assert opt.static_bytes(params, pb, dp) == pytest.approx(want)
    assert opt.static_bytes(params, pb, 1) == pytest.approx(OptimizerSetup(name).static_bytes(params, pb, 1))
    assert opt.static_bytes(params, pb, dp) < OptimizerSetup(name, sharded=True).static_bytes(params, pb, dp)
    assert opt.step_ms(params, pb, dp, 100.0, 10.0) == pytest.approx(
        OptimizerSetup(name, sharded=True).step_ms(params, pb, dp, 100.0, 10.0))
    with pytest.raises(ZbError, match="not both"):
        OptimizerSetup(name, sharded=True, fully_sharded=True)


@pytest.mark.parametrize("name, mode, dp", [("adamw", "", 4), ("mixed", "zero1", 8), ("sgd", "zero1", 2), ("mixed", "", 1),
                                            ("adamw", "fsdp", 4), ("mixed", "fsdp", 2), ("sgd", "fsdp", 1)])
def test_plan_view_holds_the_bytes_and_reductions_the_tuner_costs(name, mode, dp):
    layers = random_layers(5, 7, tied=False)
    opt = OptimizerSetup(name, sharded=mode == "zero1", fully_sharded=mode == "fsdp")
    scatter = mode == "fsdp" and dp > 1  # a reduce-scatter: half an all-reduce's traffic
    view = opt.plan_view(layers, dp)
    mesh, cluster = Mesh(2, dp, 1), Cluster(ranks=2 * dp, ranks_per_node=2 * dp, intra_node_gbs=37.0, inter_node_gbs=5)
    rng = random.Random(1)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, layers.num_units), 3))
        counts = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers.num_units]))
        cut = Cut(counts, "v")
        # plan's rule (sgd: 3x) on the view is the tuner's bytes on the model
        assert rank_static_bytes(view, cut.rank_units(), "sgd") == pytest.approx(
            rank_static(layers, counts, "v", 2, opt, dp))
        # plan's reductions on the view at the scaled bandwidth are the tuner's
        planned = stage_profile(view, cut, (dp, 37.0 * opt.bandwidth_factor(dp))) if dp > 1 else None
        costed = full_profile(layers, counts, "v", mesh, cluster, opt)
        for s, (lo, hi) in enumerate(cut.bounds):
            want = reduction_time(sum(opt.grad_bytes(u.params, u.param_bytes) for u in layers.units[lo:hi]), dp, 37.0,
                                  sharded=scatter)
            assert costed.stages[s].t_reduce == pytest.approx(want)
            if planned is not None:
                assert planned.stages[s].t_reduce == pytest.approx(want)


def test_optimizer_step_streams_the_state_and_gathers_when_sharded():
    # adamw on 1e9 parameter bytes at 1000 GB/s: 7 GB streamed, 7 ms
    assert OptimizerSetup("adamw").step_ms(250_000_000, 1e9, 4, 1000.0, 50.0) == pytest.approx(7.0)
    # sharded over 4: a quarter streamed, then 3/4 of the bytes gathered at 50 GB/s
    assert OptimizerSetup("adamw", True).step_ms(250_000_000, 1e9, 4, 1000.0, 50.0) == pytest.approx(1.75 + 15.0)
    assert OptimizerSetup("mixed").step_ms(10**9, 2e9, 1, None, 50.0) == 0.0  # not priced without a bandwidth
    with pytest.raises(ZbError, match="unknown optimizer 'lamb'"):
        OptimizerSetup("lamb")
