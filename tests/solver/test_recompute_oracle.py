"""Recomputation against the exact oracle: bounds sound over every choice, the least memory exact.

The oracle (``oracle.py``) ranges over every per-rank order and, with ``recompute=True``, every
choice of recomputation per (stage, microbatch) (none, full, or selective where offered). It is
checked first against brute-force enumeration on tiny instances, then used to judge zbsearch's
bounds (which must never exceed the optimum over every choice), its smallest feasible limit
with recomputation (a schedule exists there, none just below) and the solver's claims.
"""

from __future__ import annotations

import random

import pytest

from zbsearch import Profile, StageCost
from zbsearch.bounds import memory_makespan_lower_bound, memory_span_lower_bound, rank_area_span_lower_bounds
from zbsearch.solver import smallest_feasible_limit, solve

from .harness import TOL
from .oracle import FAMILIES, Instance, brute_force, cp_optimum_many, random_instance, with_recompute

pytestmark = pytest.mark.slow


def _instance(seed: int, tiny: bool = False):
    """An instance with recomputation offered (selective too on every other seed) and a limit
    between the least any schedule needs with recomputation and 1.5 times the least without,
    where recomputation can matter."""
    rng = random.Random(seed)
    chunks = 1 if seed % 2 else 2
    p = 2 if tiny or chunks == 2 else rng.choice([2, 3])
    m = 1 if chunks == 2 else 2  # the V with recomputation takes CP-SAT seconds at m = 2
    inst = with_recompute(rng, random_instance(rng, FAMILIES[seed % 3], p, m, chunks, "none"), selective=seed % 4 < 2)
    low = smallest_feasible_limit(inst.cost, m, "auto")
    high = smallest_feasible_limit(inst.cost, m)
    x = rng.choice([0.0, 0.5, 1.0])
    limit = [lo + x * (1.5 * hi - lo) for lo, hi in zip(low, high)]
    return inst, limit


@pytest.mark.parametrize("seed", range(8))
def test_cp_oracle_with_recomputation_equals_brute_force(seed):
    inst, limit = _instance(seed, tiny=True)
    exact, rows = brute_force(inst.cost, inst.m, limit, "span", recompute=True, max_combinations=400_000)
    (cp,) = cp_optimum_many([(inst.cost, inst.m, limit, "span", {"recompute": True})], time_limit=20)
    assert cp.optimal and cp.value == pytest.approx(exact, rel=1e-12)


@pytest.fixture(scope="module")
def optima():
    cases = [_instance(100 + k) for k in range(10)]
    jobs = [(inst.cost, inst.m, limit, obj, {"recompute": True}) for inst, limit in cases for obj in ("span", "makespan")]
    results = cp_optimum_many(jobs, time_limit=20, processes=2)
    return [(inst, limit, obj, res) for (inst, limit), pair in zip(cases, zip(results[::2], results[1::2]))
            for obj, res in zip(("span", "makespan"), pair)]


def test_bounds_never_exceed_the_optimum_over_every_recomputation(optima):
    assert all(res.optimal for *_, res in optima)
    for inst, limit, objective, res in optima:
        bound = (memory_span_lower_bound if objective == "span" else memory_makespan_lower_bound)(inst.cost, inst.m, limit)
        assert bound <= res.value * (1 + TOL), (inst.profile.name, objective, bound, res.value)


def test_some_optimum_recomputes(optima):
    """The sample exercises recomputation: some optimal schedules hold recompute passes."""
    assert any(any(a.op.value.startswith("R") for row in res.rows for a in row) for _, _, _, res in optima)


def test_smallest_limit_with_recomputation_is_exact():
    """A schedule exists at zbsearch's smallest feasible limit with recomputation, none 1% below
    it on the V, where recomputation lowers it (one chunk: one microbatch's activations either way)."""
    for seed in (0, 2, 4):
        inst, _ = _instance(seed, tiny=True)
        least = smallest_feasible_limit(inst.cost, inst.m, "auto")
        assert least[0] < smallest_feasible_limit(inst.cost, inst.m)[0] * (1 - 1e-9)
        (res,) = cp_optimum_many([(inst.cost, inst.m, least, "span", {"recompute": True})], time_limit=20)
        assert res.optimal
        with pytest.raises(ValueError, match="no schedule meets the memory limit"):
            cp_optimum_many([(inst.cost, inst.m, [x * 0.99 for x in least], "span", {"recompute": True})], time_limit=20)


def test_solver_claims_hold_with_recomputation(optima):
    for inst, limit, objective, res in optima[:8]:
        out = solve(inst.profile, inst.m, limit, chunks=inst.chunks, objective=objective, recompute="auto", time_limit=4)
        assert out.info.value >= res.value * (1 - TOL)  # else the oracle missed a schedule
        assert out.info.lower_bound <= res.value * (1 + TOL)
        assert out.info.status != "optimal" or out.info.value <= res.value * (1 + TOL)


def _window_bound(seed: int) -> Instance:
    """Two stages, three microbatches: short forwards before a long backward on the last stage,
    so that rank 0 would fill its wait for the first B with forwards if memory let it, and a
    limit (1.25 to 1.75 microbatches) where only checkpointed ones fit: the start of the area
    bound, where microbatches count whole and the first B's must be rebuilt, decides there."""
    rng = random.Random(seed)
    g = 1 / 16
    stages = []
    for _ in range(2):
        m_w = rng.randint(8, 16) / 32
        stages.append(StageCost(t_f=rng.randint(4, 8) * g, t_b=rng.randint(16, 32) * g, t_w=rng.randint(4, 12) * g,
                                m_f=1.0, m_b=-(1 - m_w), m_w=-m_w, t_r=rng.randint(4, 8) * g, m_fc=rng.randint(1, 4) / 32,
                                t_rs=g, m_fs=rng.randint(9, 15) / 32))
    prof = Profile(name="window-p2", memory_unit="activations", stages=stages, t_comm=rng.randint(0, 2) * g)
    x = rng.choice([1.25, 1.5, 1.75])
    return Instance("window", prof, 3, 1, [x, x], f"{x} M_B")


def test_area_bound_in_whole_microbatches_never_exceeds_the_optimum():
    """The area bound counts microbatches whole (an integer program) and rebuilds the first
    B's: on instances where that raises it above its LP relaxation it must still stay at or
    below the exact optimum over every order and choice of recomputation."""
    cases = [_window_bound(seed) for seed in range(200, 204)]
    results = cp_optimum_many([(i.cost, i.m, i.limit, "span", {"recompute": True}) for i in cases],
                              time_limit=20, processes=2)
    raised = 0
    for inst, res in zip(cases, results):
        assert res.optimal
        whole = max(rank_area_span_lower_bounds(inst.cost, inst.m, inst.limit))
        relaxed = max(rank_area_span_lower_bounds(inst.cost, inst.m, inst.limit, whole=False))
        assert relaxed <= whole * (1 + TOL)
        assert whole <= res.value * (1 + TOL), (inst.limit, whole, res.value)
        assert memory_span_lower_bound(inst.cost, inst.m, inst.limit) <= res.value * (1 + TOL)
        raised += whole > relaxed * (1 + TOL)
    assert raised  # the sample exercises the integer program


def _whole_at_once_instance(seed: int) -> Instance:
    """Two stages, three microbatches, W freeing most of a microbatch's memory (B little), a
    limit of 1 to 1.9 microbatches: at most one microbatch is whole at once on a rank, from its
    forward (or recompute pass) to the end of its backward, which ``rank_area_span_lower_bounds``
    counts (its ``_whole_at_once`` row)."""
    rng = random.Random(seed)
    g = 1 / 16
    stages = []
    for _ in range(2):
        m_b = -rng.randint(0, 8) / 32
        stages.append(StageCost(t_f=rng.randint(4, 12) * g, t_b=rng.randint(8, 32) * g, t_w=rng.randint(4, 16) * g,
                                m_f=1.0, m_b=m_b, m_w=-(1 + m_b), t_r=rng.randint(4, 12) * g, m_fc=rng.randint(0, 4) / 32))
    prof = Profile(name="at-once-p2", memory_unit="activations", stages=stages, t_comm=rng.randint(0, 2) * g)
    x = rng.randint(32, 60) / 32
    return Instance("at-once", prof, 3, 1, [x, x], f"{x} M_B")


def test_whole_at_once_never_exceeds_the_optimum(monkeypatch):
    """Counting the microbatches a rank can hold whole at once raises the area bound on some
    instances and never above the exact optimum over every order, fused or split backward and
    choice of recomputation."""
    import zbsearch.bounds as bounds

    cases = [_whole_at_once_instance(seed) for seed in (304, 305, 307, 308, 310, 311)]
    results = cp_optimum_many([(i.cost, i.m, i.limit, "span", {"recompute": True, "fused": True}) for i in cases],
                              time_limit=20, processes=2)
    counted = [max(rank_area_span_lower_bounds(i.cost, i.m, i.limit)) for i in cases]
    monkeypatch.setattr(bounds, "_whole_at_once", lambda *a: None)
    without = [max(rank_area_span_lower_bounds(i.cost, i.m, i.limit)) for i in cases]
    for inst, res, bound, before in zip(cases, results, counted, without):
        assert res.optimal
        assert before <= bound * (1 + TOL)
        assert bound <= res.value * (1 + TOL), (inst.limit, bound, res.value)
    assert sum(b > w * (1 + TOL) for b, w in zip(counted, without)) >= 2  # the sample exercises the row
