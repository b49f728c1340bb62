"""Pooling rounds of a profile (zbsearch.pooling): each number the median over the rounds (link
times their mean), memory balanced, drift measured and warned about, mismatches refused."""

from __future__ import annotations

import random
import statistics

import pytest

from tests.helpers import check_first_stage_way, make_profile
from zbsearch.errors import ZbError
from zbsearch.formats.profile import Links, Measurement, Quartiles, StageSpread, WayNotTaken
from zbsearch.pooling import DRIFT_LIMIT, drift, pool_profiles


def _q(x: float) -> Quartiles:
    return Quartiles(median=x, q1=0.9 * x, q3=1.1 * x, mean=1.01 * x)


def _round(rng: random.Random, p: int, scale: float = 1.0):
    """A profile as one profiler round might give: random times, a measured block, links."""
    stages = [tuple(scale * rng.uniform(0.5, 3.0) for _ in range(3)) for _ in range(p)]
    prof = make_profile(p, stages=stages, t_comm=[rng.uniform(0.01, 0.5) for _ in range(p - 1)])
    costs = [st.model_copy(update={"t_bw": scale * rng.uniform(1.0, 5.0), "t_ff": st.t_f * rng.uniform(0.8, 1.0),
                                   "m_f": rng.uniform(1, 2)}) for st in prof.stages]
    costs = [c.model_copy(update={"m_w": -(c.m_f + c.m_b)}) for c in costs]
    measured = Measurement(stages=[StageSpread(t_f=_q(c.t_f), t_b=_q(c.t_b), t_w=_q(c.t_w), t_bw=_q(c.t_bw),
                                               t_ff=_q(c.t_ff)) for c in costs],
                           warnings=["same in every round"])
    links = Links(method="measured", one_way_ms=[Quartiles(median=t, q1=t, q3=t, mean=t) for t in prof.t_comm])
    return prof.model_copy(update={"stages": costs, "measured": measured, "links": links,
                                   "t_send": [rng.uniform(0, 0.3) for _ in range(p - 1)],
                                   "t_recv": [rng.uniform(0, 0.3) for _ in range(p - 1)]})


@pytest.mark.parametrize("seed", range(20))
def test_pooled_numbers_are_the_rounds_medians_and_the_links_mean(seed):
    rng = random.Random(seed)
    p, n = rng.randint(2, 5), rng.randint(2, 6)
    rounds = [_round(rng, p) for _ in range(n)]
    pooled = pool_profiles(rounds)
    for s in range(p):
        for k in ("t_f", "t_b", "t_w", "t_bw", "t_ff", "m_f"):
            assert getattr(pooled.stages[s], k) == pytest.approx(statistics.median(getattr(r.stages[s], k) for r in rounds))
        st = pooled.stages[s]
        assert st.m_f + st.m_b + st.m_w == pytest.approx(0, abs=1e-9)
        spread = pooled.measured.stages[s]
        assert spread.t_f.median == pytest.approx(statistics.median(r.measured.stages[s].t_f.median for r in rounds))
        assert spread.t_ff.median == pytest.approx(statistics.median(r.measured.stages[s].t_ff.median for r in rounds))
    for b in range(p - 1):
        assert pooled.t_comm[b] == pytest.approx(statistics.fmean(r.t_comm[b] for r in rounds))
        assert pooled.t_comm[b] == pytest.approx(pooled.links.one_way_ms[b].mean)  # the record agrees with the cost
        assert pooled.t_send[b] == pytest.approx(statistics.median(r.t_send[b] for r in rounds))
    # order does not matter; every round is recorded
    assert pool_profiles(rounds[::-1]).stages == pooled.stages
    assert pooled.measured.rounds["count"] == n
    assert [[row["t_f"] for row in rnd] for rnd in pooled.measured.rounds["stages"]] == \
        [[st.t_f for st in r.stages] for r in rounds]
    assert pooled.measured.warnings.count("same in every round") == 1


def test_a_round_without_t_ff_pools_none_and_the_forward_costs_t_f():
    """Rounds from a profiler that predates t_ff (or a mix): the pooled stage has none, so F
    before a fused backward falls back to t_f, and its measured spread has none either."""
    rng = random.Random(7)
    rounds = [_round(rng, 2) for _ in range(3)]
    old = rounds[1]
    spreads = [sp.model_copy(update={"t_ff": None}) for sp in old.measured.stages]
    rounds[1] = old.model_copy(update={
        "stages": [st.model_copy(update={"t_ff": None}) for st in old.stages],
        "measured": old.measured.model_copy(update={"stages": spreads}),
    })
    pooled = pool_profiles(rounds)
    assert all(st.t_ff is None and st.fused_forward == st.t_f for st in pooled.stages)
    assert all(sp.t_ff is None for sp in pooled.measured.stages)
    assert all("t_ff" not in row for row in pooled.measured.rounds["drift"])
    assert pool_profiles([rounds[0], rounds[2]]).stages[0].t_ff is not None


def test_one_round_is_the_profile_itself_and_identical_rounds_do_not_drift():
    r = _round(random.Random(0), 3)
    assert pool_profiles([r]) is r
    pooled = pool_profiles([r, r, r])
    assert pooled.stages == r.stages
    assert all(d == 0 for row in drift([r, r]) for d in row.values())
    assert not any("changed speed" in w for w in pooled.measured.warnings)


def test_a_round_on_a_slower_machine_is_drift_and_a_warning():
    rng = random.Random(1)
    base = _round(rng, 2)
    slow = base.model_copy(update={"stages": [st.model_copy(update={"t_f": st.t_f * 1.2}) for st in base.stages]})
    rows = drift([base, slow, base])
    assert [row["t_f"] for row in rows] == pytest.approx([0.2, 0.2])
    assert all(row["t_b"] == 0 for row in rows)
    warned = [w for w in pool_profiles([base, slow, base]).measured.warnings if "changed speed" in w]
    assert 0.2 > DRIFT_LIMIT and len(warned) == 1 and "2 pass time(s)" in warned[0] and "up to 20% (stage" in warned[0]
    assert " F)" in warned[0]
    # the median ignores the one slow round
    assert pool_profiles([base, slow, base]).stages[0].t_f == base.stages[0].t_f


def test_profiles_of_other_stages_are_not_pooled():
    with pytest.raises(ZbError, match="not of the same stages"):
        pool_profiles([make_profile(2), make_profile(3)])
    with pytest.raises(ZbError, match="no profile"):
        pool_profiles([])


@pytest.mark.parametrize("seed", range(20))
def test_a_first_stage_measured_both_ways_pools_each_way_and_keeps_the_cheaper(seed):
    """Rounds may pick different ways for the first stage's W where the ways are close: each
    way's times are pooled over the rounds (the round's own way from its stage, the other from
    its record) and the way cheaper pooled is kept, with the other recorded."""
    rng = random.Random(seed)
    p, n = rng.randint(2, 4), rng.choice([2, 3, 5])
    rounds = []
    want: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(n):
        r = _round(rng, p)
        own = rng.random() < 0.5
        st = r.stages[0].model_copy(update={"deferred_first": own})
        other = tuple(rng.uniform(0.5, 3.0) for _ in range(3))
        want[own].append((st.t_f, st.t_b, st.t_w))
        want[not own].append(other)
        not_taken = WayNotTaken(w="plain" if own else "deferred",
                                **{k: _q(x / 1.01) for k, x in zip(("t_f", "t_b", "t_w"), other)})  # mean: x
        spread = r.measured.stages[0].model_copy(update={"not_taken": not_taken})
        measured = r.measured.model_copy(update={"stages": [spread, *r.measured.stages[1:]]})
        rounds.append(r.model_copy(update={"stages": [st, *r.stages[1:]], "measured": measured}))
    pooled = pool_profiles(rounds)
    best = check_first_stage_way(pooled, want)
    assert pooled.measured.stages[0].not_taken.w == ("plain" if best else "deferred")
    assert [st.t_f for st in pooled.stages[1:]] == pytest.approx(
        [statistics.median(r.stages[s].t_f for r in rounds) for s in range(1, p)])
    assert not any(s.deferred_first for s in pooled.stages[1:])


def _layer_round(rng: random.Random, base):
    """A per-layer profile as one round might measure ``base``: every unit's times and memory moved."""
    units = []
    for u in base.units:
        change = {k: getattr(u, k) * rng.uniform(0.5, 2.0) for k in ("t_f", "t_b", "t_w", "t_bw", "t_ff")
                  if getattr(u, k) is not None}
        m_f, m_b = u.m_f * rng.uniform(0.9, 1.1), u.m_b * rng.uniform(0.9, 1.1)
        units.append(u.model_copy(update={**change, "m_f": m_f, "m_b": m_b, "m_w": -(m_f + m_b)}))
    return base.model_copy(update={"units": units})


@pytest.mark.parametrize("seed", range(10))
def test_pooled_layers_are_each_units_medians(seed):
    from zbsearch.planner import llama_layers
    from zbsearch.pooling import pool_layers

    rng = random.Random(seed)
    base = llama_layers(rng.randint(1, 4), vocab=1000, hidden=64, heads=4, seq=16)
    if seed % 2:  # measured profiles have the fused passes too
        base = base.model_copy(update={"units": [u.model_copy(update={"t_bw": 0.9 * (u.t_b + u.t_w), "t_ff": u.t_f})
                                                 for u in base.units]})
    rounds = [_layer_round(rng, base) for _ in range(rng.randint(2, 5))]
    pooled = pool_layers(rounds)
    assert pooled.names == base.names
    for i, u in enumerate(pooled.units):
        for k in ("t_f", "t_b", "t_w", "t_bw", "t_ff", "m_f", "m_b"):
            if getattr(base.units[i], k) is None:
                assert getattr(u, k) is None
                continue
            assert getattr(u, k) == pytest.approx(statistics.median(getattr(r.units[i], k) for r in rounds))
        assert u.m_f + u.m_b + u.m_w == pytest.approx(0, abs=1e-6)
        assert (u.params, u.param_bytes, u.output_bytes) == (base.units[i].params, base.units[i].param_bytes,
                                                             base.units[i].output_bytes)
    assert pool_layers(rounds[::-1]).units == pooled.units
    assert pool_layers(rounds[:1]) == rounds[0]


def test_pooling_layers_of_other_units_is_refused():
    from zbsearch.planner import llama_layers
    from zbsearch.pooling import pool_layers

    a = llama_layers(2, vocab=1000, hidden=64, heads=4, seq=16)
    b = llama_layers(3, vocab=1000, hidden=64, heads=4, seq=16)
    with pytest.raises(ZbError, match="not of the same units"):
        pool_layers([a, b])
    with pytest.raises(ZbError, match="no per-layer profile"):
        pool_layers([])


@pytest.mark.parametrize("seed", range(10))
def test_a_negligible_pass_that_drifts_is_no_warning(seed):
    """A first stage's B with no input gradient takes microseconds: its rounds range widely
    (timer resolution, call overhead) while the machine kept its speed. Below
    NEGLIGIBLE_SHARE of its stage's F + B + W no drift of it is warned; just above, it is."""
    from zbsearch.tolerances import NEGLIGIBLE_SHARE

    rng = random.Random(seed)
    p = rng.randint(2, 4)
    base = _round(rng, p)
    s = rng.randrange(p)
    st = base.stages[s]
    for share, warned in ((NEGLIGIBLE_SHARE * rng.uniform(0.001, 0.9), False), (NEGLIGIBLE_SHARE * rng.uniform(1.2, 5), True)):
        tiny = share * (st.t_f + st.t_w) / (1 - share)  # t_b = share of t_f + t_b + t_w
        low, high = (base.model_copy(update={"stages": [c.model_copy(update={"t_b": tiny * f}) if i == s else c
                                                       for i, c in enumerate(base.stages)]}) for f in (1.0, 1.4))
        rounds = [low, high, low]
        assert drift(rounds)[s]["t_b"] == pytest.approx(0.4)  # the drift is still recorded
        lines = [w for w in pool_profiles(rounds).measured.warnings if "changed speed" in w]
        assert bool(lines) == warned, (share, lines)
