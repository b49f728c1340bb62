"""``tune`` of a mixture-of-experts model: the expert-parallel degree given, schedules with
overlapped pairs costed as pairs, DualPipeV among the baselines."""

from __future__ import annotations

import json

import pytest

import zbsearch as zb
from zbsearch.errors import ZbError
from zbsearch.formats.layers import LayerProfile
from zbsearch.planner import llama_layers
from zbsearch.prediction import timeline
from zbsearch.tuner import Cluster, OptimizerSetup, tune
from zbsearch.tuner.baselines import baseline_configurations
from zbsearch.tuner.costing import on_cluster
from zbsearch.tuner.evaluate import Task, evaluate
from zbsearch.tuner.launch import write_launch
from zbsearch.tuner.space import configurations


def _moe(share: float = 0.35, ep: int = 2, layers: int = 8) -> list[LayerProfile]:
    """Llama-like units at two microbatch sizes whose layers' F and B hold ``share`` of
    all-to-all, measured at ``ep``."""
    out = []
    for b, rate in ((1, 30.0), (2, 40.0)):
        L = llama_layers(layers, 512, 8000, heads=8, seq=512, microbatch_size=b, tflops=rate, name=f"moe-b{b}",
                         recompute=False)
        units = [u.model_copy(update={"a_f": share * u.t_f, "a_b": share * u.t_b}) if u.kind == "layer" else u
                 for u in L.units]
        out.append(L.model_copy(update={"units": units, "ep": ep}))
    return out


def test_meshes_hold_whole_expert_groups_and_dualpipe_v_is_a_baseline():
    ref = _moe()[0]
    configs, left = configurations(ref.num_units, 8, 1, 32, [1, 2], ("one", "v"), ("none",), ep=4)
    assert configs and all(c.mesh.dp % 4 == 0 for c in configs)
    assert any("expert-parallel degree 4 does not divide the 2" in x for x in left)
    bases, _ = baseline_configurations(ref, 8, 1, 32, [1, 2], ep=2)
    dpv = [c for c in bases if c.source == "DualPipeV"]
    assert dpv and all(c.placement == "v" and c.method == "dualpipe-v" and c.m >= 2 * c.mesh.pp for c in dpv)
    assert all(c.mesh.dp % 2 == 0 for c in bases)
    plain = ref.model_copy(update={"units": [u.model_copy(update={"a_f": 0.0, "a_b": 0.0}) for u in ref.units]})
    assert not any(c.source == "DualPipeV" for c in baseline_configurations(plain, 8, 1, 32, [1, 2])[0])


def test_a_dualpipe_v_baseline_is_costed_with_its_pairs():
    """Its iteration is its schedule's, pairs and reductions included, and below the same order
    with nothing overlapped."""
    profiles = _moe()
    cluster = Cluster(ranks=4, ranks_per_node=4, memory_bytes=None, intra_node_gbs=50.0, inter_node_gbs=5.0)
    c = next(c for c in baseline_configurations(profiles[0], 4, 1, 16, [1], ep=2)[0] if c.source == "DualPipeV")
    layers = on_cluster(profiles[0], c.mesh, cluster)
    ev = evaluate(Task(c, layers, cluster, OptimizerSetup("adamw"), 1.0, 0.0))
    assert ev.status == "costed" and ev.schedule is not None and ev.pairs == ev.schedule.num_pairs > 0
    assert zb.find_problem(ev.schedule) is None
    assert max(ev.schedule.predicted.iteration) == pytest.approx(ev.costed.iteration)
    serial = timeline(ev.schedule.model_copy(update={"overlapped": None}))
    assert ev.costed.span < max(serial.span)


@pytest.mark.parametrize("dp, sharded", [(2, False), (4, False), (8, False), (4, True)])
def test_expert_gradients_reduce_across_their_copies_only(dp, sharded):
    """A stage's reduction: its other gradients as a ring over the dp replicas, its expert ones
    over the dp / ep copies of each expert (none where ep = dp), each by the ring's formula
    written out here; plan's stage profiles and tune's costing agree, and the unit reductions
    tune bounds with add up to its stages'."""
    from zbsearch.planner import Cut, stage_profile
    from zbsearch.tuner.cluster import Mesh
    from zbsearch.tuner.costing import full_profile, unit_reductions

    ref = _moe(ep=2)[0]
    units = [u.model_copy(update={"expert_params": int(0.8 * u.params), "expert_param_bytes": 2.0 * int(0.8 * u.params)})
             if u.kind == "layer" else u for u in ref.units]
    layers = ref.model_copy(update={"units": units})
    assert sum(u.expert_params for u in units) > 0
    gbs, counts = 25.0, [3, 3, 4]

    def ring(nbytes: float, n: int) -> float:
        steps = (n - 1) * (1 if sharded else 2)
        return steps / n * nbytes / (gbs * 1e9) * 1e3 if n > 1 else 0.0

    bounds = [(0, 3), (3, 6), (6, 10)]
    want = [ring(sum(u.param_bytes - u.expert_param_bytes for u in units[lo:hi]), dp)
            + ring(sum(u.expert_param_bytes for u in units[lo:hi]), dp // 2) for lo, hi in bounds]
    planned = stage_profile(layers, Cut(tuple(counts), "one"), data_parallel=(dp, gbs), sharded=sharded)
    assert [st.t_reduce for st in planned.stages] == pytest.approx(want)
    assert planned.data_parallel.expert_replicas == dp // 2
    whole = ring(sum(u.param_bytes for u in units[3:6]), dp)
    assert planned.stages[1].t_reduce < whole  # all of it over dp: the price before experts were told apart
    cluster = Cluster(ranks=3 * dp, ranks_per_node=3 * dp, memory_bytes=None, intra_node_gbs=gbs, inter_node_gbs=gbs)
    mesh = Mesh(pp=3, dp=dp, tp=1)
    opt = OptimizerSetup("adamw", fully_sharded=sharded)
    costed = full_profile(layers, counts, "one", mesh, cluster, opt)
    assert [st.t_reduce for st in costed.stages] == pytest.approx(want)
    per_unit = unit_reductions(layers, mesh, cluster, opt)
    assert [sum(per_unit[lo:hi]) for lo, hi in bounds] == pytest.approx(want)


def test_expert_parameters_must_fit_the_unit_and_the_replicas_the_groups():
    from zbsearch.planner import Cut, stage_profile

    u = _moe()[0].units[1]
    with pytest.raises(ValueError, match="expert parameters exceed"):
        type(u).model_validate({**u.model_dump(), "expert_params": u.params + 1})
    with pytest.raises(ZbError, match="expert-parallel degree 2 .* does not divide the 3"):
        stage_profile(_moe(ep=2)[0], Cut((5, 5), "one"), data_parallel=(3, 10.0))


@pytest.mark.slow  # tunes for seconds
def test_tune_with_experts_picks_pairs_and_beats_every_baseline(tmp_path):
    profiles = _moe()
    cluster = Cluster(ranks=8, ranks_per_node=8, memory_bytes=None, intra_node_gbs=50.0, inter_node_gbs=5.0)
    tuned = tune(profiles, cluster, 32, time_limit=8.0, plan_time=0.4, recompute=["none"])
    res = tuned.result
    assert res.ep == 2 and all(r.dp % 2 == 0 for r in res.rows)
    assert res.winner is not None and tuned.schedule is not None and zb.find_problem(tuned.schedule) is None
    costed = [r for r in res.rows if r.status == "costed"]
    assert any(r.source == "DualPipeV" for r in costed)
    assert all(res.winner.iteration_ms <= r.iteration_ms * (1 + 1e-9) for r in costed)
    assert res.winner.overlapped_pairs == tuned.schedule.num_pairs
    assert any(r.overlapped_pairs for r in costed if r.source == "tune")
    assert max(tuned.schedule.predicted.iteration) == pytest.approx(res.winner.iteration_ms)
    assert all(r.bound_ms <= r.iteration_ms * (1 + 1e-9) for r in costed if r.source == "tune")
    write_launch(tmp_path, res, tuned.schedule, tuned.layers)
    launch = json.loads((tmp_path / "launch.json").read_text())
    assert launch["ep"] == 2 and any("groups of 2" in n for n in launch["notes"])
    assert zb.load_schedule(tmp_path / "schedule.json").num_pairs == tuned.schedule.num_pairs


def test_the_degree_given_must_be_the_profiles():
    cluster = Cluster(ranks=8, ranks_per_node=8, memory_bytes=None, intra_node_gbs=50.0, inter_node_gbs=5.0)
    with pytest.raises(ZbError, match="measured at ep 2; profile the model at --ep 4") as e:
        tune(_moe(), cluster, 32, ep=4, time_limit=2.0)
    assert "\n" not in str(e.value)
    with pytest.raises(ZbError, match="expert-parallel degrees 2, 4"):
        tune([_moe()[0], _moe(ep=4)[1]], cluster, 32, time_limit=2.0)


def test_tune_ep_on_the_command_line(tmp_path, capsys):
    """``--ep`` as the profiles were measured at: the best line names it; another: one line."""
    from tests.helpers import run_main
    from zbsearch.formats.layers import save_layers

    paths = []
    for L in _moe():
        paths += ["-l", tmp_path / f"{L.name}.json"]
        save_layers(L, paths[-1])
    code, text, err = run_main(capsys, "tune", *paths, "-r", 4, "-g", 16, "--ep", 2, "-t", 4, "--plan-time", 0.3,
                               "--recompute", "none", "--no-baselines", "-o", tmp_path / "out")
    assert code == 0, err
    assert "(ep 2)" in text and json.loads((tmp_path / "out" / "tune.json").read_text())["ep"] == 2
    code, _, err = run_main(capsys, "tune", *paths, "-r", 4, "-g", 16, "--ep", 4, "-t", 4)
    assert code != 0 and "measured at ep 2" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
