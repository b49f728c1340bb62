"""Cutting units into stages: the composed stage costs, memory, baselines and the refusals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.layers import random_layers
from zbsearch.errors import ZbError
from zbsearch.formats.layers import LayerProfile, load_layers, save_layers
from zbsearch.formats.partition import check_names
from zbsearch.planner import Cut, baseline_cuts, parameter_bytes, rank_static_bytes, stage_profile
from zbsearch.planner.analytic import llama_layers
from zbsearch.planner.relaxation import min_max_cut, relaxed_bound
from zbsearch.planner.search import compositions


def test_a_stage_adds_up_its_units_and_the_first_stage_runs_its_backward_in_w():
    L = random_layers(1, 6)
    # measured units: a unit's plain forward (t_ff) costs less than its split one (t_f)
    L = L.model_copy(update={"units": [x.model_copy(update={"t_ff": 0.8 * x.t_f}) for x in L.units]})
    prof = stage_profile(L, Cut((3, 2, 3), "one"))
    u = L.units
    first, mid = prof.stages[0], prof.stages[1]
    # a first stage's forward is not split: its units' plain forwards
    assert first.t_f == pytest.approx(sum(x.fused_forward for x in u[:3]))
    assert first.t_f == first.fused_forward
    assert mid.t_f == pytest.approx(u[3].t_f + u[4].t_f)  # later stages split theirs
    assert mid.fused_forward == pytest.approx(u[3].fused_forward + u[4].fused_forward)
    assert first.t_b == pytest.approx(u[0].t_b)  # no input gradient on the first stage
    assert first.t_w == pytest.approx(u[0].t_w + u[1].fused_backward + u[2].fused_backward)
    assert first.m_b == pytest.approx(u[0].m_b) and first.m_f == pytest.approx(sum(x.m_f for x in u[:3]))
    assert mid.t_b == pytest.approx(u[3].t_b + u[4].t_b) and mid.t_w == pytest.approx(u[3].t_w + u[4].t_w)
    assert mid.fused_backward == pytest.approx(u[3].fused_backward + u[4].fused_backward)
    assert mid.m_b + mid.m_w == pytest.approx(-mid.m_f)
    assert prof.t_comm == [L.comm(2), L.comm(4)]
    assert prof.placement is None


def test_a_v_cut_is_pieces_on_their_ranks():
    L = random_layers(2, 6)
    cut = Cut((1, 2, 1, 1, 1, 2), "v")
    prof = stage_profile(L, cut)
    assert prof.placement == [0, 1, 2, 2, 1, 0] == cut.stage_to_rank
    assert cut.rank_units() == [[0, 6, 7], [1, 2, 5], [3, 4]]


@given(st.integers(3, 12), st.integers(1, 5), st.sampled_from(["one", "v"]))
@settings(max_examples=60, deadline=None)
def test_every_composition_keeps_every_unit_once_in_order(n, ranks, placement):
    stages = ranks * (2 if placement == "v" else 1)
    if stages > n:
        return
    cuts = list(compositions(n, stages))
    assert len(cuts) == math.comb(n - 1, stages - 1) == len(set(cuts))
    for c in cuts[:50]:
        Cut(c, placement).check(n)
        names = [f"u{i}" for i in range(n)]
        lo, per = 0, []
        for k in c:
            per.append(names[lo:lo + k])
            lo += k
        assert check_names(per, names) is None


@pytest.mark.parametrize("stages, expected", [
    ([["a", "b"], ["d"]], "unit 'c' is dropped (stage 1 has 'd' in its place)"),
    ([["a", "b"], ["b", "c", "d"]], "unit 'b' is repeated (again on stage 1)"),
    ([["a", "c"], ["b", "d"]], "unit 'c' is out of order on stage 0 (expected 'b' there)"),
    ([["a", "b", "c"]], "unit 'd' is dropped (the last stage ends before it)"),
    ([["a", "b"], [], ["c", "d"]], "stage 1 holds no unit"),
    ([["a", "x"], ["c", "d"]], "stage 0 names 'x', which is not a unit of the model"),
])
def test_a_cut_that_drops_repeats_or_reorders_is_named_in_one_line(stages, expected):
    assert check_names(stages, ["a", "b", "c", "d"]) == expected


def test_bad_counts_are_one_line():
    with pytest.raises(ZbError, match=r"holds 7 units but the model has 8"):
        Cut((3, 4), "one").check(8)
    with pytest.raises(ZbError, match="stage 1 of the cut"):
        Cut((8, 0), "one").check(8)
    with pytest.raises(ZbError, match="multiple of 2"):
        Cut((3, 3, 2), "v").check(8)


def test_static_memory_counts_tied_parameters_once_per_rank():
    L = random_layers(3, 4, tied=True)
    tied = parameter_bytes(50_000, 2e5, "adamw")
    own = [parameter_bytes(u.params, u.param_bytes, "adamw") for u in L.units]
    # the V puts the embedding and the head on rank 0: one copy there
    cut = Cut((1, 1, 2, 2), "v")
    got = rank_static_bytes(L, cut.rank_units(), "adamw")
    assert got[0] == pytest.approx(own[0] + own[4] + own[5] + tied)
    # one stage per rank: a copy on the first and on the last rank
    got = rank_static_bytes(L, Cut((2, 4), "one").rank_units(), "adamw")
    assert got == pytest.approx([own[0] + own[1] + tied, sum(own[2:]) + tied])
    assert parameter_bytes(10, 40.0, "sgd") == 120 and parameter_bytes(10, 40.0, "mixed") == 160
    with pytest.raises(ZbError, match="unknown optimizer"):
        parameter_bytes(1, 4.0, "lion")


@pytest.mark.parametrize("layers, stages, even, torchtitan, megatron", [
    (8, 4, [2, 2, 2, 2], [2, 3, 2, 1], [2, 3, 3, 2]),  # 10 effective layers
    (30, 4, [8, 8, 7, 7], [7, 8, 8, 7], [7, 8, 8, 7]),  # torchtitan: 32 -> 8 each, ends one less
    (6, 4, [2, 2, 1, 1], [1, 2, 2, 1], [1, 2, 2, 1]),
])
def test_baselines_follow_their_rules(layers, stages, even, torchtitan, megatron):
    L = random_layers(0, layers)
    got = {b.name: b for b in baseline_cuts(L, stages, "one")}
    for name, want in (("even", even), ("torchtitan", torchtitan), ("megatron", megatron)):
        b = got[name]
        eff = layers + 2
        if name == "megatron" and eff % stages:
            assert b.cut is None and "divide evenly" in (b.note or "")
            continue
        assert b.cut is not None
        per = [k - (s == 0) - (s == stages - 1) for s, k in enumerate(b.cut.counts)]
        assert per == want, name


def test_layer_files_round_trip_and_refuse_bad_tied_names(tmp_path):
    L = llama_layers(4, 256, 1000, heads=4, seq=64, tied=True)
    save_layers(L, tmp_path / "l.json")
    assert load_layers(tmp_path / "l.json") == L
    data = L.model_dump()
    data["units"][1]["tied"] = ["nope"]
    with pytest.raises(ValueError, match="names tied parameters 'nope'"):
        LayerProfile.model_validate(data)
    with pytest.raises(ZbError, match="no such per-layer profile"):
        load_layers(tmp_path / "missing")


@given(st.integers(0, 10_000), st.integers(2, 9), st.integers(2, 4))
@settings(max_examples=40, deadline=None)
def test_min_max_cut_is_the_best_of_every_cut(seed, n, stages):
    import random

    rng = random.Random(seed)
    w = [rng.uniform(0.1, 3.0) for _ in range(n)]
    if stages > n:
        return

    def worst(c):
        lo, out = 0, 0.0
        for k in c:
            out = max(out, sum(w[lo:lo + k]))
            lo += k
        return out

    best = min(worst(c) for c in compositions(n, stages))
    assert worst(min_max_cut(w, stages)) == pytest.approx(best)


def test_relaxed_bound_is_below_every_cuts_quick_bound():
    from zbsearch.planner.search import Cuts

    L = random_layers(5, 7)
    for placement, ranks in (("one", 3), ("v", 2)):
        space = Cuts(L, ranks, placement, 4, None, "adamw", "span")
        relaxed = relaxed_bound(L, ranks, placement, 4)
        for c in compositions(L.num_units, space.num_stages):
            assert relaxed <= space.evaluate(c).key * (1 + 1e-9)
