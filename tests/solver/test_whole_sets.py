"""The area bound's whole sets and the stages a V rank cannot hold whole together, against the
exact oracle over every order, fused or split backward and choice of recomputation.

``rank_area_span_lower_bounds`` counts what a rank can hold with all of m_f at once per stage
(``_whole_sets``) and, on a rank whose stages cannot be whole together (``_apart``), leaves out
the plain way and starts the recompute pass after the later stage's B. Both must keep every
bound at or below the optimum; a variant that forces recomputation wherever a later stage
exists (the memory test forgotten) must not, so the sample can tell.
"""

from __future__ import annotations

import random

import pytest

import zbsearch.bounds as bounds
from zbsearch import Profile, StageCost
from zbsearch.bounds import memory_span_lower_bound, rank_area_span_lower_bounds, rank_relay_span_lower_bounds
from zbsearch.solver import smallest_feasible_limit

from .harness import TOL
from .oracle import FAMILIES, Instance, cp_optimum_many, random_instance, with_fused, with_recompute

pytestmark = pytest.mark.slow

_GAP = 1e-3  # an integer program's proven bound moves within HiGHS' gap when rows are added


def _v_instance(seed: int, m: int = 1) -> tuple[Instance, bool]:
    """A V on two ranks, ``m`` microbatches, recomputation offered (selective too on even
    seeds), fused backwards on odd seeds at one microbatch, and a limit from the least any
    schedule needs with recomputation to past the two stages of a rank whole together: below
    that, the earlier stage must recompute after the later one's B."""
    rng = random.Random(seed)
    base = random_instance(rng, FAMILIES[seed % 3], 2, m, 2, "none")
    fused = m == 1 and seed % 2 == 1
    inst = with_recompute(rng, with_fused(rng, base) if fused else base, selective=seed % 2 == 0)
    cost = inst.cost
    low = smallest_feasible_limit(cost, m, "auto")
    both = [sum(cost.m_f[s] for s in cost.rank_stages(r)) for r in range(cost.num_ranks)]
    x = rng.choice([0.25, 0.5, 0.75, 1.5])
    return Instance(inst.family, inst.profile, m, 2, [lo + x * (hi - lo) for lo, hi in zip(low, both)], f"{x}"), fused


def _slow_recompute(seed: int) -> Instance:
    """A V on two ranks, one microbatch, room for both stages of a rank whole, and recompute
    passes far slower than the rest: no optimum recomputes."""
    inst, _ = _v_instance(seed)
    g = 1 / 16
    stages = [st.model_copy(update={"t_r": 8.0 + st.t_f, "t_rs": None if st.t_rs is None else 8.0 + g})
              for st in inst.profile.stages]
    prof = inst.profile.model_copy(update={"stages": stages})
    cost = Instance(inst.family, prof, 1, 2, None, "none").cost
    both = [sum(cost.m_f[s] for s in cost.rank_stages(r)) for r in range(cost.num_ranks)]
    return Instance(inst.family, prof, 1, 2, [1.5 * b for b in both], "1.5 both")


def _one_instance(seed: int) -> Instance:
    """One stage per rank on two ranks, three microbatches, B freeing most of a microbatch's
    memory, recomputation offered, a limit of 1 to 1.9 microbatches: a microbatch holds all of
    m_f from its forward (or recompute pass) to the end of its B, one at a time."""
    rng = random.Random(seed)
    g = 1 / 16
    stages = []
    for _ in range(2):
        m_w = -rng.randint(0, 8) / 32
        stages.append(StageCost(t_f=rng.randint(4, 12) * g, t_b=rng.randint(4, 16) * g, t_w=rng.randint(8, 32) * g,
                                m_f=1.0, m_b=-(1 + m_w), m_w=m_w, t_r=rng.randint(4, 12) * g, m_fc=rng.randint(0, 4) / 32))
    prof = Profile(name="sets-p2", memory_unit="activations", stages=stages, t_comm=rng.randint(0, 2) * g)
    x = rng.randint(32, 60) / 32
    return Instance("sets", prof, 3, 1, [x, x], f"{x} M_B")


def _bounds(inst: Instance) -> list[float]:
    """The area and relay bounds' largest rank and the full span bound."""
    c, m, lim = inst.cost, inst.m, inst.limit
    assert lim is not None
    return [max(rank_area_span_lower_bounds(c, m, lim)), max(rank_relay_span_lower_bounds(c, m, lim)),
            memory_span_lower_bound(c, m, lim)]


@pytest.fixture(scope="module")
def cases():
    v = [_v_instance(seed) for seed in range(400, 412)] + [_v_instance(seed, 2) for seed in (603, 604, 609, 613)]
    one = [(_one_instance(seed), True) for seed in range(500, 506)]
    jobs = [(i.cost, i.m, i.limit, "span", {"recompute": True, "fused": f}) for i, f in v + one]
    return list(zip([i for i, _ in v + one], cp_optimum_many(jobs, time_limit=20, processes=2)))


def test_whole_sets_and_apart_stages_never_exceed_the_optimum(cases, monkeypatch):
    counted = [_bounds(inst) for inst, _ in cases]
    monkeypatch.setattr(bounds, "_whole_sets", lambda *a: None)
    monkeypatch.setattr(bounds, "_apart", lambda *a: [])
    without = [_bounds(inst) for inst, _ in cases]
    for (inst, res), got, before in zip(cases, counted, without):
        assert res.optimal
        assert all(b <= g * (1 + _GAP) for b, g in zip(before, got)), (inst.limit, before, got)
        assert all(g <= res.value * (1 + TOL) for g in got), (inst.profile.name, inst.limit, got, res.value)
    raised = [g[0] > b[0] * (1 + TOL) for g, b in zip(counted, without)]
    assert sum(raised) >= 2  # the sample exercises them


def test_recomputing_wherever_a_later_stage_exists_is_caught(monkeypatch):
    """The rule without its memory test (every earlier stage of a V recomputes after the later
    one's B) goes above the optimum where recomputing does not pay: the test above can fail."""
    cases = [_slow_recompute(seed) for seed in range(400, 404)]
    results = cp_optimum_many([(i.cost, i.m, i.limit, "span", {"recompute": True}) for i in cases], time_limit=20,
                              processes=2)
    assert all(max(rank_area_span_lower_bounds(i.cost, i.m, i.limit)) <= res.value * (1 + TOL) for i, res in zip(cases, results))
    monkeypatch.setattr(bounds, "_apart", lambda cost, r, s, room: [x for x in cost.rank_stages(r) if x > s])
    assert any(max(rank_area_span_lower_bounds(i.cost, i.m, i.limit)) > res.value * (1 + TOL) for i, res in zip(cases, results))
