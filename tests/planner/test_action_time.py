"""The runtime's host time per action on a per-layer profile (``LayerProfile.t_action``): old
files load and cost what they did, every stage a cut composes gets it whole, the cost model adds
it once per pass, and a 1F1B on composed stages takes (m + P - 1) x 2 host times longer, as its
critical path holds m + P - 1 forwards and as many backwards."""

from __future__ import annotations

import json
import math
import random

import pytest
from pydantic import ValidationError

import zbsearch as zb
from tests.helpers import run_main
from tests.helpers.layers import random_layers
from zbsearch.actions import Op
from zbsearch.costs import CostModel
from zbsearch.formats.layers import LayerProfile, LinkEstimate, Unit, load_layers, save_layers
from zbsearch.planner import Cut, plan, stage_profile
from zbsearch.planner.search import compositions
from zbsearch.tuner.sizes import SizedLayers


def test_old_files_load_without_it_and_cost_what_they_did(tmp_path):
    L = random_layers(3, 4)
    path = tmp_path / "old.json"
    doc = json.loads(L.model_dump_json())
    doc.pop("t_action", None)  # as written before the field
    path.write_text(json.dumps(doc))
    old = load_layers(path)
    assert old.t_action is None
    cut = Cut((2, 2, 2), "one")
    owner = cut.stage_to_rank
    assert stage_profile(old, cut).t_action is None
    zero = old.model_copy(update={"t_action": 0.0})
    assert CostModel.from_profile(stage_profile(old, cut), owner) == CostModel.from_profile(stage_profile(zero, cut), owner)
    timed = old.model_copy(update={"t_action": 0.125})
    save_layers(timed, path)
    back = load_layers(path)
    assert back.t_action == 0.125 and back == timed


@pytest.mark.parametrize("bad", [-0.01, float("inf"), float("nan"), 2e9])
def test_bad_host_times_are_refused(bad):
    doc = random_layers(1, 2).model_dump() | {"t_action": bad}
    with pytest.raises(ValidationError):
        LayerProfile.model_validate(doc)


def _cuts(L: LayerProfile, rng: random.Random, n: int):
    for _ in range(n):
        placement = rng.choice(["one", "v"])
        ranks = rng.choice([2, 3]) if placement == "v" else rng.choice([2, 3, 4])
        stages = ranks * (2 if placement == "v" else 1)
        counts = rng.choice(list(compositions(L.num_units, stages)))
        yield Cut(tuple(counts), placement)


@pytest.mark.parametrize("seed", range(6))
def test_every_composed_stage_gets_it_whole_and_every_pass_pays_it_once(seed):
    rng = random.Random(seed)
    L = random_layers(seed, rng.randint(6, 10), recompute=rng.choice(["none", "full", "both"]))
    h = rng.uniform(0.01, 0.5)
    timed = L.model_copy(update={"t_action": h})
    for cut in _cuts(L, rng, 8):
        plain, got = stage_profile(L, cut), stage_profile(timed, cut)
        assert got.t_action == h and got.stages == plain.stages  # the passes' own times are the units'
        with_dp = stage_profile(timed, cut, data_parallel=(4, 50.0))
        assert with_dp.t_action == h  # with the reductions too
        owner = cut.stage_to_rank
        c, c0 = CostModel.from_profile(got, owner), CostModel.from_profile(plain, owner)
        for s in range(len(owner)):  # whole on each piece of a V, not half
            for op in (Op.F, Op.B, Op.W, Op.BW):
                assert c.time(s, op) == pytest.approx(c0.time(s, op) + h, abs=1e-12), (cut, s, op)
            for op in c0.recompute_ops(s):
                o, o0 = c.offer(s, op), c0.offer(s, op)
                assert o is not None and o0 is not None
                assert (o.t_f, o.t_r) == pytest.approx((o0.t_f + h, o0.t_r + h))


def test_profiles_at_other_microbatch_sizes_take_the_nearest_measured_sizes():
    sizes = SizedLayers([random_layers(2, 4).model_copy(update={"microbatch_size": b, "t_action": b / 10}) for b in (1, 4)])
    assert [sizes.at(b).t_action for b in (1, 2, 3, 4, 8)] == [0.1, 0.1, 0.4, 0.4, 0.4]


def _uniform(P: int, f: float, b: float, h: float | None) -> LayerProfile:
    """P like units, one per stage: F ``f`` (split or not), BW ``b``, no link time."""
    unit = dict(kind="unit", t_f=f, t_ff=f, t_b=b / 2, t_w=b / 2, t_bw=b, m_f=1.0, m_b=-0.5, m_w=-0.5)
    return LayerProfile(name="uniform", units=[Unit(name=f"u{i}", **unit) for i in range(P)],
                        link=LinkEstimate(latency_ms=0.0, bandwidth_gb_s=1.0), t_action=h)


@pytest.mark.parametrize("seed", range(20))
def test_a_1f1b_takes_two_host_times_longer_per_step_of_its_critical_path(seed):
    """1F1B on P like stages: (m + P - 1)(F + BW) (the first rank's m forwards and backwards, and
    P - 1 of each on the way down and back); each of those actions pays the host time."""
    rng = random.Random(seed)
    P, m = rng.randint(2, 5), rng.randint(1, 8)
    f, b, h = rng.uniform(0.5, 2.0), rng.uniform(0.5, 3.0), rng.uniform(0.01, 0.7)
    spans = []
    for x in (None, h):
        prof = stage_profile(_uniform(P, f, b, x), Cut((1,) * P, "one"))
        sched = zb.build_classic("1f1b", prof, m)
        spans.append(zb.simulate(sched.rank_actions, CostModel.from_profile(prof, sched.stage_to_rank)).makespan)
    assert spans[0] == pytest.approx((m + P - 1) * (f + b))
    assert spans[1] - spans[0] == pytest.approx((m + P - 1) * 2 * h)


@pytest.mark.parametrize("placement", ["one", "v"])
def test_a_plan_prices_it_as_a_hand_built_stage_profile_does(placement):
    """The plan's value is its schedule simulated on the stage profile built by hand from the
    units (sums, no compose), with the host time; without it the same schedule is shorter."""
    L = _uniform(8, 1.0, 2.0, 0.25)
    res = plan(L, 2, 4, None, placement=placement, time_limit=2.0, milp=False)
    sched, part = res.schedule, res.partition
    assert part is not None and sched.profile.t_action == 0.25
    owner = sched.stage_to_rank
    hand = []
    for names in part.stages:
        k = len(names)
        first = names[0] == "u0"  # the first stage runs its W as one plain backward (BW of its units, B its first's)
        hand.append(zb.StageCost(t_f=k * 1.0, t_ff=k * 1.0, t_b=1.0 if first else k * 1.0,
                                 t_w=k * 2.0 - 1.0 if first else k * 1.0, t_bw=k * 2.0,
                                 m_f=k * 1.0, m_b=-0.5 if first else -0.5 * k, m_w=-0.5 * k if not first else 0.5 - k))
    for x in (0.25, None):
        prof = zb.Profile(name="hand", memory_unit="bytes", stages=hand, t_comm=0.0, t_action=x,
                          placement=owner if placement == "v" else None)
        span = zb.simulate(sched.rank_actions, CostModel.from_profile(prof, owner)).span
        if x:
            assert part.value == pytest.approx(max(span))
        else:
            actions = sum(len(row) for row in sched.rank_actions)  # no path holds more
            assert max(span) < part.value <= max(span) + 0.25 * actions + 1e-9
    assert math.isfinite(part.lower_bound) and part.lower_bound <= part.value + 1e-9


def test_plan_takes_it_from_a_number_or_a_stage_profile(tmp_path, capsys):
    layers = tmp_path / "layers.json"
    save_layers(_uniform(4, 1.0, 2.0, None), layers)
    measured = tmp_path / "stages.json"
    zb.save_profile(zb.load_profile("unit-p4").model_copy(update={"t_action": 0.375}), measured)
    for given, want in (("0.25", 0.25), (str(measured), 0.375)):
        out = tmp_path / "plan.json"
        code, _, err = run_main(capsys, "plan", "-l", layers, "-r", "2", "-m", "2", "-t", "1", "--no-milp",
                                "--placement", "one", "--action-ms", given, "-o", out)
        assert code == 0, err
        code, text, _ = run_main(capsys, "plan", "-l", layers, "-r", "2", "-m", "2", "-t", "1", "--no-milp",
                                 "--placement", "one", "--action-ms", given)
        assert code == 0 and f"host time per action, {want:.3g} ms" in text
        assert zb.load_schedule(out).profile.t_action == want


@pytest.mark.parametrize("command", ["plan", "tune"])
def test_bad_host_times_are_one_line(tmp_path, capsys, command):
    layers = tmp_path / "layers.json"
    save_layers(_uniform(4, 1.0, 2.0, None).model_copy(update={"microbatch_size": 1}), layers)
    without = tmp_path / "stages.json"
    zb.save_profile(zb.load_profile("unit-p4"), without)
    args = ["-r", "2", "-m", "2"] if command == "plan" else ["-r", "2", "-g", "4"]
    for given, words in (("-1", "--action-ms -1: give a time in ms (0 or more)"), ("nan", "give a time in ms"),
                         (str(tmp_path / "none.json"), "neither a time in ms nor a stage profile file"),
                         (str(without), "the profile records no t_action"), (str(layers), "format")):
        out = tmp_path / "out"
        code, _, err = run_main(capsys, command, "-l", layers, *args, "-t", "1", "--action-ms", given, "-o", out)
        assert code == 1 and err.count("\n") == 1 and words in err, err
        assert not out.exists()


@pytest.mark.parametrize("seed", range(16))
def test_the_bound_over_every_cut_counts_it_and_its_program_still_finds_the_least(seed):
    """The relaxed bound's program against each cut's bound computed directly, with a host time;
    the bound rises by at least two host times per microbatch and piece on the busiest rank's work."""
    from tests.planner.test_relaxation import _instance
    from zbsearch.planner.relaxation import RankBounds, relaxed_bound, work_bound

    L0, ranks, placement, m, budget, recompute = _instance(seed)
    h = random.Random(seed).uniform(0.05, 0.6)
    L = L0.model_copy(update={"t_action": h})
    ranked = RankBounds(L, ranks, placement, m, recompute, budget, "adamw", None, "span")
    stages = ranks * (2 if placement == "v" else 1)
    direct = min(ranked.cut_value(c) for c in compositions(L.num_units, stages))
    got = relaxed_bound(L, ranks, placement, m, recompute, budget=budget)
    assert got == pytest.approx(direct, rel=1e-12) or got == direct == math.inf
    if math.isfinite(got):  # every rank's: two per microbatch and piece on its busy time, one of them on its forwards'
        assert got >= relaxed_bound(L0, ranks, placement, m, recompute, budget=budget) + m * h - 1e-9
    assert work_bound(L, ranks, placement, m, recompute) >= work_bound(L0, ranks, placement, m, recompute) + m * 2 * h - 1e-9


@pytest.mark.slow  # brute force over every schedule of every cut
@pytest.mark.parametrize("seed", range(8))
def test_with_a_host_time_the_bound_is_below_every_cuts_exact_optimum(seed):
    """Tiny models (2 ranks, one stage each or a V), every schedule of every cut by brute force
    on the costs with the host time: the bound over every cut is never above the best."""
    from tests.solver.oracle import brute_force
    from zbsearch.planner.relaxation import relaxed_bound
    from zbsearch.solver.problem import Problem

    rng = random.Random(2000 + seed)
    placement = "one" if seed % 2 else "v"
    L = random_layers(seed, 2, head=rng.uniform(1, 5), comm=rng.choice([0.0, 0.3]))
    L = L.model_copy(update={"t_action": rng.uniform(0.1, 1.0)})
    m = 1 if placement == "v" else 2
    best = math.inf
    for counts in compositions(L.num_units, 2 * (2 if placement == "v" else 1)):
        cut = Cut(counts, placement)
        cost = Problem.make(CostModel.from_profile(stage_profile(L, cut), cut.stage_to_rank), m).cost
        best = min(best, brute_force(cost, m, None, "span", fused=True, max_combinations=500_000)[0])
    bound = relaxed_bound(L, 2, placement, m)
    assert bound <= best * (1 + 1e-9)
    assert bound > relaxed_bound(L.model_copy(update={"t_action": None}), 2, placement, m)


@pytest.mark.parametrize("seed, pp, placement, m", [(1, 2, "one", 4), (2, 3, "one", 3), (3, 2, "v", 4), (4, 1, "one", 3)])
def test_the_tuners_bound_before_planning_holds_with_it(seed, pp, placement, m):
    """Every cut's classic schedules (1F1B, ZB-H1, GPipe; ZB-V) on the iteration with the host
    time: none below the configuration's bound, which rises with the host time."""
    from zbsearch.tuner import Cluster, Mesh, OptimizerSetup
    from zbsearch.tuner.bounds import config_bound
    from zbsearch.tuner.costing import full_profile

    L0 = random_layers(seed, 5, head=3.0)
    L = L0.model_copy(update={"t_action": 0.3})
    dp = 2
    cluster = Cluster(ranks=pp * dp, ranks_per_node=dp, intra_node_gbs=0.2, inter_node_gbs=0.05, memory_gbs=0.5)
    mesh, opt = Mesh(pp, dp, 1), OptimizerSetup("adamw")
    bound = config_bound(L, mesh, placement, m, "none", cluster, opt)
    kinds = ("zb-v",) if placement == "v" else ("1f1b", "zb-h1", "gpipe")
    least = math.inf
    for counts in compositions(L.num_units, pp * (2 if placement == "v" else 1)):
        prof = full_profile(L, counts, placement, mesh, cluster, opt)
        assert prof.t_action == 0.3
        for kind in kinds:
            least = min(least, max(zb.build_classic(kind, prof, m).predicted.iteration))
    assert 0 < bound <= least * (1 + 1e-9)
    assert bound > config_bound(L0, mesh, placement, m, "none", cluster, opt)
