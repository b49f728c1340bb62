"""Plans of mixture-of-experts models: units with expert-parallel all-to-all.

A cut's stages hold their units' all-to-all, a first stage with experts split as the runtime
splits it; the bound over every cut stays below every schedule with overlapped pairs (the exact
oracle with pairing, on tiny models); a plan picks pairs, validates, and is never slower than
DualPipeV at DualPipeV's own memory; units without all-to-all compose as before.
"""

from __future__ import annotations

import math
import random

import pytest

import zbsearch as zb
from tests.helpers.layers import moe_layers, random_layers
from tests.solver.test_overlap_oracle import _optima
from zbsearch.formats.layers import LayerProfile, LinkEstimate, Unit
from zbsearch.planner import Cut, plan, stage_profile
from zbsearch.planner.compose import stage_cost, static_bytes
from zbsearch.planner.relaxation import RankBounds, relaxed_bound
from zbsearch.planner.search import Cuts, compositions

TOL = 1e-9


@pytest.mark.parametrize("seed", range(20))
def test_stages_hold_their_units_all_to_all_and_a_first_stage_with_experts_is_split(seed):
    L = moe_layers(seed, 6)
    plain = L.model_copy(update={"units": [u.model_copy(update={"a_f": 0.0, "a_b": 0.0}) for u in L.units], "ep": 1})
    rng = random.Random(seed)
    counts = next(c for c in compositions(L.num_units, 4) if rng.random() < 0.2 or c == (5, 1, 1, 1))
    for lo, hi in Cut(counts, "one").bounds:
        us, got, was = L.units[lo:hi], stage_cost(L, lo, hi), stage_cost(plain, lo, hi)
        assert got.a_f == pytest.approx(sum(u.a_f for u in us)) and got.a_b == pytest.approx(sum(u.a_b for u in us))
        split = lo > 0 or any(u.kind == "layer" for u in us)  # the first stage with experts: split, as later ones
        assert got.t_f == pytest.approx(sum(u.t_f for u in us) if split else sum(u.fused_forward for u in us))
        assert got.t_b == pytest.approx(sum(u.t_b for u in us) if split else us[0].t_b)
        assert got.t_w == pytest.approx(sum(u.t_w for u in us) if split else was.t_w)
        assert got.t_b + got.t_w == pytest.approx(sum(u.t_b + u.t_w for u in us)) or not split
        if lo:  # later stages: nothing but the all-to-all differs from the same units without it
            assert got.model_copy(update={"a_f": 0.0, "a_b": 0.0}) == was
    prof = stage_profile(L, Cut(counts, "one"))
    assert prof.has_all_to_all and prof.ep == 8 and prof.mesh is not None and prof.mesh.pp == 4
    old = stage_profile(plain, Cut(counts, "one"))  # units without all-to-all: no mesh section, nothing to overlap
    assert not old.has_all_to_all and old.mesh is None and not plain.has_all_to_all


def _tiny(seed: int) -> LayerProfile:
    """An embedding, two layers with all-to-all and a head; W free (t_w = 0, m_w = 0, t_bw = t_b)
    and no parameters, so that the oracle's forwards and fused backwards are every schedule."""
    rng = random.Random(seed)
    units = []
    for name, kind, scale in (("embedding", "embedding", 0.3), ("layer.0", "layer", 1.0), ("layer.1", "layer", 1.0),
                              ("head", "head", rng.uniform(0.5, 2.0))):
        t_f, t_b = round(scale * rng.uniform(0.5, 1.5), 2), round(scale * rng.uniform(0.6, 2.0), 2)
        share = (rng.uniform(0.1, 0.6), rng.uniform(0.1, 0.6)) if kind == "layer" else (0.0, 0.0)
        m_f = float(rng.choice([1, 2])) * 8192
        units.append(Unit(name=name, kind=kind, t_f=t_f, t_b=t_b, t_w=0.0, t_bw=t_b, m_f=m_f, m_b=-m_f, m_w=0.0,
                          a_f=round(t_f * share[0], 3), a_b=round(t_b * share[1], 3)))
    return LayerProfile(name=f"tiny-moe-{seed}", units=units, link=LinkEstimate(latency_ms=0.05, bandwidth_gb_s=1e9), ep=2)


def test_no_bound_above_the_exact_optimum_with_pairs():
    """Two ranks, one stage each, m = 2: every cut's optimum over every order and every choice
    of pairs (the exact oracle); the bound over every cut and each cut's own bound below it."""
    paid = cuts = 0
    for seed in range(8):
        L, m = _tiny(seed), 2
        budget = None if seed % 2 else 3 * 8192 * 2.0
        space = Cuts(L, 2, "one", m, budget, "adamw", "span")
        best = math.inf
        for counts in compositions(L.num_units, 2):
            cut = Cut(counts, "one")
            ev = space.evaluate(counts)
            if not ev.feasible:
                continue
            cost = zb.CostModel.from_profile(stage_profile(L, cut), cut.stage_to_rank)
            value = _optima(cost, m, ev.limit)["span"]
            if math.isinf(value):
                continue
            assert ev.key <= value * (1 + TOL), (seed, counts)
            paid += value < _optima(cost.without_all_to_all(), m, ev.limit)["span"] - TOL
            cuts += 1
            best = min(best, value)
        assert best < math.inf
        assert relaxed_bound(L, 2, "one", m, budget=budget) <= best * (1 + TOL), seed
        ranks = RankBounds(L, 2, "one", m, budget=budget)
        assert min(ranks.cut_value(c) for c in compositions(L.num_units, 2)) <= best * (1 + TOL), seed
    assert paid >= cuts // 4, (paid, cuts)  # the oracle is not trivial: pairs pay on a share of the cuts


def test_the_bound_over_cuts_counts_passes_at_their_least_in_a_pair():
    """The same units with their all-to-all hidden or not: the bound with pairs possible is lower,
    and below every plan's value."""
    L = moe_layers(4, 10, share=0.35)
    plain = L.model_copy(update={"units": [u.model_copy(update={"a_f": 0.0, "a_b": 0.0}) for u in L.units]})
    for placement in ("one", "v"):
        assert relaxed_bound(L, 2, placement, 8) < relaxed_bound(plain, 2, placement, 8)


@pytest.mark.slow  # plans: seconds each
@pytest.mark.parametrize("seed", range(3))
def test_a_plan_picks_pairs_validates_and_beats_dualpipe_v_at_its_memory(seed):
    """The budget is DualPipeV's own peak on the even V cut (static memory plus its activations):
    the plan fits it and is at least as fast as DualPipeV there (with pairs, or with another
    cut where none pay); with memory to spare it overlaps pairs."""
    L, p, m = moe_layers(seed, 10, share=0.3), 2, 8
    even = next(c for c in zb.planner.baseline_cuts(L, p, "v") if c.name == "even").cut
    assert even is not None
    prof = stage_profile(L, even)
    dpv = zb.build_classic("dualpipe-v", prof, m)
    assert dpv.num_pairs > 0
    budget = max(s + a for s, a in zip(static_bytes(L, even, "adamw"), dpv.predicted.peak_memory))
    res = plan(L, p, m, budget, placement="auto", time_limit=5)
    sched = res.schedule
    assert zb.find_problem(sched) is None and sched.solver.overlapped_pairs == sched.num_pairs
    assert res.partition.value <= max(dpv.predicted.span) * (1 + TOL)
    peaks = [s + a for s, a in zip(res.partition.static_bytes, res.partition.activation_bytes)]
    assert max(peaks) <= budget * (1 + 1e-9)
    got = {b.name: b for b in res.partition.baselines}
    mine = got["dualpipe-v (even cut)"]
    assert mine.value == pytest.approx(max(dpv.predicted.span)) and mine.overlapped_pairs == dpv.num_pairs
    assert all(b.value is None or b.value >= res.partition.value * (1 - TOL) for b in got.values())
    assert res.partition.lower_bound <= res.partition.value
    free = plan(L, p, m, None, placement="v", time_limit=3)  # memory to spare: pairs pay
    assert zb.find_problem(free.schedule) is None and free.schedule.num_pairs > 0
    assert free.partition.value <= min(b.value for b in free.partition.baselines if b.value) * (1 + TOL)


def test_units_without_all_to_all_plan_as_before():
    """No all-to-all: no DualPipeV baseline, no pairs, the same bound as the units' own."""
    L = random_layers(2, 8)
    res = plan(L, 2, 8, None, placement="v", time_limit=1.5)
    assert res.schedule.num_pairs == 0 and res.schedule.profile.mesh is None
    assert not any(b.name.startswith("dualpipe-v") for b in res.partition.baselines)
    assert all(b.overlapped_pairs == 0 for b in res.partition.baselines)


def test_the_plan_command_lists_dualpipe_v_and_the_pairs(capsys, tmp_path):
    from tests.helpers import run_main
    from zbsearch.formats.layers import save_layers

    save_layers(moe_layers(5, 8, share=0.35), tmp_path / "moe.json")
    code, text, err = run_main(capsys, "plan", "-l", tmp_path / "moe.json", "-r", 2, "-m", 8, "--placement", "v",
                               "-t", 2, "-o", tmp_path / "s.json")
    assert code == 0, err
    sched = zb.load_schedule(tmp_path / "s.json")
    assert "dualpipe-v" in text and "(even cut)" in text and "pairs" in text
    assert (f"{sched.num_pairs} overlapped pairs" in text) == (sched.num_pairs > 0)
