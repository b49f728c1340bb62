"""Recomputation in the planner's stage costs: composed from the units', the memory need a cut
has with it (against the solver's own least feasible limit), generated Llama profiles, the
relaxed bound and the refusals."""

from __future__ import annotations

import random

import pytest

from tests.helpers.layers import random_layers
from zbsearch.costs import CostModel
from zbsearch.errors import ZbError
from zbsearch.planner import Cut, llama_layers, plan, stage_profile
from zbsearch.planner.compose import activation_need
from zbsearch.planner.relaxation import unit_work, work_bound
from zbsearch.planner.search import compositions
from zbsearch.solver.feasibility import smallest_feasible_limit
from zbsearch.solver.problem import Problem


def test_a_checkpointed_stage_keeps_its_input_and_recomputes_every_unit():
    L = random_layers(1, 6, recompute="both")
    L = L.model_copy(update={"units": [x.model_copy(update={"t_ff": 0.8 * x.t_f}) for x in L.units]})
    u = L.units
    prof = stage_profile(L, Cut((3, 2, 3), "one"))
    first, mid, last = prof.stages
    for st, lo, hi in ((first, 0, 3), (mid, 3, 5), (last, 5, 8)):
        assert st.m_fc == u[lo].m_fc  # the stage's input: what enters its first unit
        assert st.t_r == pytest.approx(sum(x.t_r for x in u[lo:hi]))
        assert st.t_fc == pytest.approx(sum(x.t_fc for x in u[lo:hi]))
        # selective adds up: the layers offer it, the embedding and head keep all and recompute nothing
        offer = [x for x in u[lo:hi] if x.t_rs is not None]
        assert st.t_rs == pytest.approx(sum(x.t_rs for x in offer))
        assert st.m_fs == pytest.approx(sum(x.m_fs if x.t_rs is not None else x.m_f for x in u[lo:hi]))
    # a unit without its own t_fs runs its forward as the stage does: plain on the first stage
    assert first.t_fs == pytest.approx(u[0].fused_forward + u[1].t_fs + u[2].t_fs)
    assert last.t_fs == pytest.approx(u[5].t_fs + u[6].t_fs + u[7].t_f)
    assert all(st.t_rf is None for st in prof.stages)  # no unit measured R before a fused backward
    # where units measured it, a stage's R before a fused backward re-runs each unit's forward
    rf = L.model_copy(update={"units": [x.model_copy(update={"t_rf": 0.9 * x.t_r}) if i % 2 else x
                                        for i, x in enumerate(L.units)]})
    for st, (lo, hi) in zip(stage_profile(rf, Cut((3, 2, 3), "one")).stages, ((0, 3), (3, 5), (5, 8))):
        assert st.t_rf == pytest.approx(sum(x.t_rf or x.t_r for x in rf.units[lo:hi]))
        assert st.t_r == pytest.approx(sum(x.t_r for x in u[lo:hi]))
    # without recompute costs (older files), a stage offers none; a stage with one unit lacking
    # them offers no full recomputation
    bare = stage_profile(random_layers(1, 6), Cut((3, 2, 3), "one"))
    assert all(st.recompute() is None and st.recompute(True) is None for st in bare.stages)
    holes = L.model_copy(update={"units": [x.model_copy(update={"t_r": None, "m_fc": None, "t_fc": None})
                                           if i == 4 else x for i, x in enumerate(L.units)]})
    part = stage_profile(holes, Cut((3, 2, 3), "one"))
    assert part.stages[1].recompute() is None and part.stages[0].recompute() is not None


@pytest.mark.parametrize("seed", range(12))
def test_a_cuts_memory_need_is_the_solvers_least_limit(seed):
    """What the planner says a cut needs at least, per rank and recompute mode, equals the peak
    of the solver's sequential schedule on the composed stages, simulated."""
    rng = random.Random(seed)
    L = random_layers(seed, rng.randint(4, 9), recompute=rng.choice(["full", "both"]))
    for placement in ("one", "v"):
        ranks = rng.randint(2, max(2, L.num_units // (2 if placement == "v" else 1)))
        stages = ranks * (2 if placement == "v" else 1)
        if stages > L.num_units:
            continue
        cuts = list(compositions(L.num_units, stages))
        for counts in rng.sample(cuts, min(6, len(cuts))):
            cut = Cut(counts, placement)
            cost = CostModel.from_profile(stage_profile(L, cut), cut.stage_to_rank)
            for mode in ("none", "auto", "full"):
                want = smallest_feasible_limit(Problem.make(cost, 3, recompute=mode).cost, 3, mode)  # type: ignore[arg-type]
                assert activation_need(L, cut, mode) == pytest.approx(want, rel=1e-9), (counts, placement, mode)
            if placement == "v":  # the rank's earlier piece kept checkpointed: less than without
                assert sum(activation_need(L, cut, "auto")) < sum(activation_need(L, cut, "none"))


def test_generated_llama_units_recompute_their_forward_and_keep_their_input():
    b, s, h = 2, 128, 256
    L = llama_layers(4, h, 1000, heads=4, seq=s, microbatch_size=b)
    emb, *layers, head = L.units
    for x in (*layers, head):
        assert x.t_r == x.t_f and x.m_fc == 2 * b * s * h and x.t_fc is None
    assert emb.m_fc == 0 and emb.t_r == emb.t_f
    assert all(x.t_rs is None for x in L.units)  # fused attention: selective would keep it all
    prof = stage_profile(L, Cut((2, 2, 2), "one"))
    assert [st.m_fc for st in prof.stages] == [0, 2 * b * s * h, 2 * b * s * h]
    assert prof.stages[1].t_r == pytest.approx(prof.stages[1].t_f)  # R re-runs the stage's forward
    assert llama_layers(4, h, 1000, heads=4, seq=s, recompute=False).units[1].t_r is None


@pytest.mark.parametrize("rf", [None, 0.7, 1.2])
def test_the_relaxed_bound_counts_each_recomputed_forward_with_its_pass(rf):
    """``rf``: each unit's R before a fused backward at that share of t_r (None: not measured)."""
    L = random_layers(3, 6, recompute="both")
    if rf is not None:
        L = L.model_copy(update={"units": [x.model_copy(update={"t_rf": rf * x.t_r}) if x.t_r else x for x in L.units]})
    none, auto, full = (unit_work(L, mode) for mode in ("none", "auto", "full"))
    for u, a, b, c in zip(L.units, none, auto, full):
        back = min(u.t_b + u.t_w, u.fused_backward)
        plain = min(u.t_f, u.fused_forward)
        assert a == pytest.approx(plain + back)
        assert c == pytest.approx(min(plain, u.t_fc) + u.t_r * min(1, rf or 1) + back)
        assert b <= a and b <= c
    # below every cut's busiest rank at its cheapest, for each mode
    for mode in ("auto", "full"):
        bound = work_bound(L, 3, "one", 4, mode)
        for counts in compositions(L.num_units, 3):
            cost = Problem.make(CostModel.from_profile(stage_profile(L, Cut(counts, "one")), [0, 1, 2]), 4,
                                recompute=mode).cost  # type: ignore[arg-type]
            busy = [4 * (_least_forward(cost, s, mode) + cost.backward(s)) for s in range(3)]
            assert bound <= max(busy) * (1 + 1e-9)


def _least_forward(cost: CostModel, s: int, mode: str) -> float:
    """A microbatch's least forward work on stage s, its recompute pass included where recomputed."""
    ways = [cost.offer(s, op) for op in cost.recompute_ops(s)]
    recomputed = [o.t_f + o.t_r for o in ways if o is not None]
    return min(recomputed) if mode == "full" else min([cost.t_f[s], cost.t_ff[s], *recomputed])


@pytest.mark.parametrize("mode, units, message", [
    ("full", lambda us: [u.model_copy(update={"t_r": None, "m_fc": None, "t_fc": None}) if i == 2 else u
                         for i, u in enumerate(us)], "--recompute full: per-layer profile 'random-2' has no full "
                                                     "recomputation costs (t_r, m_fc) for unit 'layer.1'"),
    ("auto", lambda us: [u.model_copy(update={k: None for k in ("t_r", "m_fc", "t_fc", "t_rs", "m_fs")}) for u in us],
     "--recompute auto: per-layer profile 'random-2' has no recomputation costs"),
    ("some", lambda us: us, "recompute must be one of none, auto, full, not 'some'"),
])
def test_recomputation_the_units_do_not_offer_is_refused_in_one_line(mode, units, message):
    L = random_layers(2, 4, recompute="full")
    L = L.model_copy(update={"units": units(L.units)})
    with pytest.raises(ZbError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as info:
        plan(L, 2, 4, None, recompute=mode, time_limit=1)
    assert "\n" not in str(info.value)


@pytest.mark.slow  # the solver runs
def test_a_budget_only_recomputation_meets_is_named_and_met_with_it():
    from zbsearch.planner.compose import static_bytes

    L = random_layers(4, 6, recompute="full")
    cuts = [Cut(c, "v") for c in compositions(L.num_units, 4)]

    def least(mode: str) -> float:  # the least budget some cut fits, its schedule recomputing as ``mode`` allows
        return min(max(s + n for s, n in zip(static_bytes(L, c, "adamw"), activation_need(L, c, mode))) for c in cuts)

    assert least("auto") < least("none")
    budget = (least("auto") + least("none")) / 2
    with pytest.raises(ZbError, match=r"no cut fits a budget of .*; with --recompute auto some cut fits$"):
        plan(L, 2, 4, budget, placement="v", time_limit=1)
    res = plan(L, 2, 4, budget, placement="v", time_limit=2, recompute="auto")
    assert res.schedule.solver is not None and res.schedule.solver.recomputed > 0
